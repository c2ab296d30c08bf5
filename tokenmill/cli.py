"""`tokenmill serve | bench ...`: each subcommand's flags and entry point live in its own module."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)

    from tokenmill.server import api_server
    serve = sub.add_parser("serve", help="serve a model behind the OpenAI API")
    api_server.add_cli_args(serve)
    serve.set_defaults(func=api_server.run_from_cli)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    from tokenmill.bench import throughput
    tp = bench.add_parser("throughput", help="offline throughput of the engine")
    throughput.add_cli_args(tp)
    tp.set_defaults(func=throughput.main)
    from tokenmill.bench import step
    st = bench.add_parser("step", help="where one engine step's time goes: ops, sampling, scheduling, front end")
    step.add_cli_args(st)
    st.set_defaults(func=step.main)
    from tokenmill.bench import serve as bench_serve
    bs = bench.add_parser("serve", help="goodput of an OpenAI-compatible endpoint: sweeps, SLOs, reports",
                          allow_abbrev=False)  # with --launch, unknown flags go to `tokenmill serve` whole
    bench_serve.add_cli_args(bs)
    bs.set_defaults(func=bench_serve.main)

    # Only `bench serve --launch` takes flags it does not know: they are passed to `tokenmill serve`.
    args, extra = parser.parse_known_args(argv)
    if args.func is bench_serve.main:
        return args.func(args, extra) or 0
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
