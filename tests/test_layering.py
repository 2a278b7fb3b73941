"""The project's dependency rules, checked on the code: every module's imports (read with
`ast`, function-level ones included), and what importing a module really loads (a fresh
Python).

- `shared` imports neither service; the services never import each other.
- Protobuf and gRPC stay at the edges: servicers, clients and their conversion functions.
- The scheduler and the KV cache import no torch; importing the scheduler loads none, and
  neither does the frontend (a CPU pod that should start in a second) or the engine's gRPC
  server process (the engine core, in processes of its own, runs the model).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine_svc", "frontend_svc", "shared")
# Where protobuf and gRPC may be imported: servicers, clients, conversions, the generated
# code's import points. Prefixes of dotted module names.
EDGES = (
    "engine_svc.server",
    "frontend_svc.server",
    "frontend_svc.engines",  # the frontend's client of the engines
    "frontend_svc.client",  # the command-line client
    "frontend_svc.launcher",  # health-checks the services it starts
    "frontend_svc.serve",
    "engine_svc.bench",  # the benchmarks: gRPC clients of the services they measure
    "shared.protos",
    "shared.frontend_protos",
    "shared.grpc_auth",
    "shared.grpc_tls",
    "shared.grpc_errors",
    "shared.grpc_request_decoding",
    "shared.grpc_request_streams",
    "shared.grpc_server",
    "shared.health_check",  # the exec probe: a health client
    "shared.metrics.grpc_server",
)
PROTOBUF_ROOTS = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf", "smg_grpc_proto")
PROTOBUF_MODULES = ("shared.protos", "shared.frontend_protos")
NO_TORCH = ("engine_svc.core.sched", "engine_svc.core.kv_cache")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imports(name: str, path: Path) -> set[str]:
    """Every module `name` imports, anywhere in its code, as absolute dotted names."""
    imported = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            imported.add(base)
            imported.update(f"{base}.{alias.name}" for alias in node.names)
    return imported


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


MODULES = _modules()
IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def _violations(rule) -> list[str]:  # type: ignore[no-untyped-def]
    return sorted(
        f"{name} imports {target}"
        for name, targets in IMPORTS.items()
        for target in targets
        if rule(name, target)
    )


def test_the_layout_is_read() -> None:
    assert {"engine_svc.core.sched.scheduler", "frontend_svc.service", "shared.errors"} <= set(
        MODULES
    )
    assert "engine_svc.core.sched.output" in IMPORTS["engine_svc.core.sched.scheduler"]


def test_shared_imports_neither_service() -> None:
    assert (
        _violations(
            lambda name, target: (
                name.startswith("shared") and _within(target, ("engine_svc", "frontend_svc"))
            )
        )
        == []
    )


def test_the_services_never_import_each_other() -> None:
    assert (
        _violations(
            lambda name, target: (
                (name.startswith("engine_svc") and _within(target, ("frontend_svc",)))
                or (name.startswith("frontend_svc") and _within(target, ("engine_svc",)))
            )
        )
        == []
    )


def test_protobuf_and_grpc_stay_at_the_edges() -> None:
    assert (
        _violations(
            lambda name, target: (
                not _within(name, EDGES)
                and (_within(target, PROTOBUF_ROOTS) or _within(target, PROTOBUF_MODULES))
            )
        )
        == []
    )


def test_the_scheduler_and_kv_cache_import_no_torch() -> None:
    assert (
        _violations(lambda name, target: _within(name, NO_TORCH) and _within(target, ("torch",)))
        == []
    )


@pytest.mark.parametrize(
    "modules",
    [
        # The scheduler and the KV-cache manager, as a unit test or another process uses them.
        ["engine_svc.core.sched.scheduler", "engine_svc.core.kv_cache.manager"],
        # Everything the frontend process runs, tokenizer included.
        ["frontend_svc.serve", "frontend_svc.__main__", "frontend_svc.client"],
        # The engine's gRPC server process: servicers and the client of the engine cores.
        ["engine_svc.server.serve", "engine_svc.server.app"],
    ],
    ids=["scheduler", "frontend", "engine-grpc-server"],
)
def test_importing_loads_no_torch(modules: list[str]) -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    assert _run_python(code) == "[]"


def test_the_frontends_tokenizer_loads_no_torch(tiny_model_dir: Path) -> None:
    """Loading the model's tokenizer and chat template, and using them, in the frontend."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from frontend_svc.messages import ChatMessage\n"
        "from frontend_svc.tokenizer import Tokenizer\n"
        f"tokenizer = Tokenizer.load(Path({str(tiny_model_dir)!r}))\n"
        "ids = tokenizer.render_chat([ChatMessage('user', 'Hi!')])\n"
        "assert tokenizer.decode(ids, skip_special_tokens=False)\n"
        "print('torch' in sys.modules)\n"
    )
    assert _run_python(code) == "False"


def _run_python(code: str) -> str:
    """What `code` prints, run in a fresh interpreter (nothing imported yet)."""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()
