"""`tokenmill serve | bench ...`: each subcommand's flags and entry point live in its own module.

A subcommand's module is imported only when that subcommand runs: `tokenmill serve` must not pay for (or carry)
the benchmarks' torch import, since the API server process imports no torch."""
from __future__ import annotations

import argparse
import importlib
import sys

from tokenmill.json_flag import fold_dotted_json_flags

# (name, help, module, entry point); the module has add_cli_args(parser)
SERVE = ("serve", "serve a model behind the OpenAI API", "tokenmill.server.launch", "run_from_cli")
ROUTER = ("router", "an OpenAI-compatible gateway over several replicas, routing on their KV caches",
          "tokenmill.router.app", "run_from_cli")
RUN_BATCH = ("run-batch", "run a file of requests in OpenAI's Batch format offline, writing the answers to a file",
             "tokenmill.server.run_batch", "run_from_cli")
# vLLM's terminal clients (tokenmill/clients.py): their module's add_*_cli_args, and run_*
CHAT = ("chat", "chat with a served model in the terminal (vLLM's vllm chat)", "tokenmill.clients", "run_chat")
COMPLETE = ("complete", "complete prompts with a served model in the terminal (vLLM's vllm complete)",
            "tokenmill.clients", "run_complete")
SERVE_RAY = ("serve-ray", "tokenmill serve replicas on Ray Serve behind the router, autoscaled on their queues "
             "(needs the ray extra); flags it does not know go to every replica's tokenmill serve",
             "tokenmill.router.ray_serve", "run_from_cli")
BENCHES = [
    ("latency", "offline latency of one batch, end to end (vLLM's bench latency)", "tokenmill.bench.latency",
     "main"),
    ("throughput", "offline throughput of the engine", "tokenmill.bench.throughput", "main"),
    ("step", "where one engine step's time goes: ops, sampling, scheduling, front end", "tokenmill.bench.step",
     "main"),
    ("serve", "goodput of an OpenAI-compatible endpoint: sweeps, SLOs, reports", "tokenmill.bench.serve", "main"),
]


def _attach(parser: argparse.ArgumentParser, module_name: str, entry: str) -> None:
    """The module's add_cli_args (add_NAME_cli_args where one module holds several commands: run_NAME)."""
    module = importlib.import_module(module_name)
    add = getattr(module, f"add_{entry.removeprefix('run_')}_cli_args", None) or module.add_cli_args
    add(parser)
    parser.set_defaults(func=getattr(module, entry))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference server")
    try:
        argv = fold_dotted_json_flags(argv)  # --structured-outputs-config.backend X, as vLLM spells it
    except ValueError as e:
        parser.error(str(e))
    sub = parser.add_subparsers(dest="command", required=True)

    chosen = None
    for name, help_, module, entry in (SERVE, RUN_BATCH, ROUTER, SERVE_RAY, CHAT, COMPLETE):
        # serve-ray: unknown flags go to `tokenmill serve` whole, so no abbreviations
        parser_ = sub.add_parser(name, help=help_, allow_abbrev=name != "serve-ray")
        if argv[:1] == [name]:
            _attach(parser_, module, entry)
            chosen = parser_

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    for name, help_, module, entry in BENCHES:
        # bench serve: with --launch, unknown flags go to `tokenmill serve` whole, so no abbreviations
        parser_ = bench.add_parser(name, help=help_, allow_abbrev=name != "serve")
        if argv[:2] == ["bench", name]:
            _attach(parser_, module, entry)

    # Only `bench serve --launch` and `serve-ray` take flags they do not know: they are passed to `tokenmill serve`.
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "config", None) and args.command in ("serve", "run-batch"):
        # vLLM's --config FILE.yaml: the file's flags first, so that the command line's override them
        from tokenmill.api.server_config import config_file_args
        try:
            from_file = config_file_args(args.config, set(chosen._option_string_actions), args.model_tag is not None)
        except ValueError as e:
            chosen.error(str(e))
        # after a leading positional model, which a list flag of the file (--served-model-name a b) would swallow
        at = 2 if argv[1:2] == [args.model_tag] else 1
        args, extra = parser.parse_known_args(argv[:at] + from_file + argv[at:])
    if args.command == "serve-ray" or args.command == "bench" and args.bench_command == "serve":
        return args.func(args, extra) or 0
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
