"""Every module of tokenmill/ on its floor: no import loops, and no import that runs upward.

The graph is grimp's (the library behind import-linter): every `import` statement of every module, those inside
functions and under TYPE_CHECKING included. FLOORS lists the floors from the ground up; a module may import its
own group and any lower floor. Groups that share a floor are independent of each other: the server and the router
both stand on tokenmill/api/ and neither imports the other. `python tests/test_layers.py` prints the summary."""
from __future__ import annotations

import grimp

# From the ground up. Each floor is a tuple of independent groups; each group, the modules (or packages) in it.
FLOORS: list[tuple[tuple[str, ...], ...]] = [
    # plain data and parsers, no torch: what every process (engine, API server, router) may load
    (("tokenmill.envs", "tokenmill.logs", "tokenmill.ports", "tokenmill.json_flag", "tokenmill.heap",
      "tokenmill.sampling_params",
      "tokenmill.pooling_params", "tokenmill.pooling_outputs", "tokenmill.kv_transfer_params", "tokenmill.logprobs", "tokenmill.outputs",
      "tokenmill.reasoning", "tokenmill.tool_parsers", "tokenmill.chat_templates", "tokenmill.gguf_file", "tokenmill.tokenizer",
      "tokenmill.detokenizer", "tokenmill.config"),),
    # the model code and what it runs on
    (("tokenmill.kernels", "tokenmill.models", "tokenmill.lora"),),
    (("tokenmill.engine",),),
    # the offline API: `import tokenmill` (its lazy __getattr__ gives LLM), LLM, beam search
    (("tokenmill", "tokenmill.llm", "tokenmill.beam_search"),),
    # what HTTP serving shares: the OpenAI shapes, the one error shape, lifecycle and drain, tracing, the flags
    (("tokenmill.api",),),
    (("tokenmill.server",), ("tokenmill.router",)),
    (("tokenmill.cli",), ("tokenmill.bench",), ("tokenmill.clients",)),
]


def place(module: str) -> tuple[int, int]:
    """(floor, group) of a module: its longest listed prefix ("tokenmill", the package's __init__, only itself)."""
    best, where = -1, None
    for floor, groups in enumerate(FLOORS):
        for group, prefixes in enumerate(groups):
            for prefix in prefixes:
                covers = module == prefix or (prefix != "tokenmill" and module.startswith(prefix + "."))
                if covers and len(prefix) > best:
                    best, where = len(prefix), (floor, group)
    if where is None:
        raise AssertionError(f"{module} is on no floor: add it to FLOORS in tests/test_layers.py")
    return where


def import_graph() -> dict[str, set[str]]:
    graph = grimp.build_graph("tokenmill", cache_dir=None)
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    found = []
    for importer, imported in sorted((a, b) for a, bs in edges.items() for b in bs):
        (fa, ga), (fb, gb) = place(importer), place(imported)
        if fb > fa or (fb == fa and gb != ga):
            found.append(f"{importer} -> {imported}")
    return found


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in edges.get(node, ()):
                        cycles.append(sorted(component))
    return cycles


def summary() -> str:
    edges = import_graph()
    up, cycles = upward_imports(edges), import_cycles(edges)
    lines = [f"tokenmill/ import graph (grimp): "
             f"{len(edges)} modules, {sum(map(len, edges.values()))} edges, {len(cycles)} cycles, "
             f"{len(up)} upward imports"]
    lines += [f"  cycle: {' <-> '.join(c)}" for c in cycles] + [f"  upward: {u}" for u in up]
    return "\n".join(lines)


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, "import loops:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_upward_imports():
    up = upward_imports(import_graph())
    assert not up, "imports that run upward (FLOORS in tests/test_layers.py):\n" + "\n".join(up)


def test_the_checks_catch_a_loop_and_an_upward_import():
    """The two checks themselves, on a made-up graph: a loop between two ground modules, and the engine
    importing the server."""
    edges = {"tokenmill.config": {"tokenmill.tokenizer"}, "tokenmill.tokenizer": {"tokenmill.config"},
             "tokenmill.engine.engine": {"tokenmill.api.errors"}, "tokenmill.api.errors": set(),
             "tokenmill.server.x": {"tokenmill.router.y"}, "tokenmill.router.y": {"tokenmill.engine.engine"}}
    assert import_cycles(edges) == [["tokenmill.config", "tokenmill.tokenizer"]]
    assert upward_imports(edges) == ["tokenmill.engine.engine -> tokenmill.api.errors",
                                     "tokenmill.server.x -> tokenmill.router.y"]


if __name__ == "__main__":
    print(summary())
