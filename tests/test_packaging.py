"""What a user installs: a regular (non-editable) wheel carries the native kernel sources and the packaged model;
every subcommand's --help works with the base dependencies only; the native kernel builds where the machine can
build it (and a build failure is an error there), and generation falls back cleanly where it cannot."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from nexttoken.model import kernels
from nexttoken.server.webui import ASSETS

ROOT = Path(__file__).resolve().parents[1]
MACHINE_CAN_BUILD = (
    subprocess.run(["sh", "-c", "command -v ${CXX:-g++}"], capture_output=True).returncode == 0
    and "avx512f" in Path("/proc/cpuinfo").read_text()
)


def _run(cmd: list[str], env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})}, cwd=cwd)


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> Path:
    """A fresh venv with the built wheel installed (not editable); torch and the other dependencies come from the
    test environment's site-packages through a .pth path line (no re-download, and no editable finder: a path
    line in a .pth does not run the .pth files of that folder)."""
    tmp = tmp_path_factory.mktemp("wheel")
    built = _run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                  "-w", str(tmp / "dist")])
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp / "dist").glob("nexttoken-*.whl")
    venv = tmp / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    assert made.returncode == 0, made.stderr
    purelib = Path(_run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
                   .stdout.strip())
    (purelib / "parent_env.pth").write_text("\n".join(site.getsitepackages() + [sysconfig.get_path("purelib")]) + "\n")
    installed = _run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps",
                      "-q", str(wheel)])
    assert installed.returncode == 0, installed.stderr
    return venv


def test_the_wheel_carries_the_kernel_sources_and_the_model_and_generates(wheel_venv: Path, tmp_path: Path) -> None:
    env = {"NEXTTOKEN_CACHE": str(tmp_path / "cache")}  # the kernel compiles from the installed sources
    probe = _run([str(wheel_venv / "bin" / "python"), "-c", textwrap.dedent("""
        import json, nexttoken
        from importlib.resources import files
        from nexttoken.server.webui import ASSETS
        from nexttoken.model import kernels
        from nexttoken.pretrained import DEFAULT_MODEL_DIR
        print(json.dumps({"file": nexttoken.__file__, "sources": [str(s) for s in kernels.SOURCES if s.is_file()],
                          "model": (DEFAULT_MODEL_DIR / "model.safetensors").is_file(),
                          "kernel": kernels.available(),
                          "webui": sorted(n for n, (package, file, _) in ASSETS.items() if (files(package) / file).is_file())}))
    """)], env, cwd=tmp_path)  # not the checkout's folder, whose nexttoken/ would shadow the installed one
    assert probe.returncode == 0, probe.stderr
    info = json.loads(probe.stdout)
    assert info["file"].startswith(str(wheel_venv)), info  # the installed copy, not this checkout
    checkout = sorted(p.name for p in (Path(__file__).resolve().parents[1] / "nexttoken" / "csrc").glob("*.cpp"))
    assert sorted(Path(s).name for s in info["sources"]) == checkout  # every kernel source of the checkout
    assert all(s.startswith(str(wheel_venv)) for s in info["sources"])
    assert info["model"]
    assert info["webui"] == sorted(ASSETS)  # the chat page's files (package data)
    assert info["kernel"] == MACHINE_CAN_BUILD
    assert list((tmp_path / "cache" / "kernels").glob("libnt_*.so")) if MACHINE_CAN_BUILD else True
    story = _run([str(wheel_venv / "bin" / "nexttoken"), "generate", "Once upon a time", "--max-new-tokens", "30"], env,
                 cwd=tmp_path)
    assert story.returncode == 0, story.stderr
    assert story.stdout.startswith("Once upon a time") and len(story.stdout.split()) > 10


def test_every_subcommand_help_works_with_the_base_dependencies_only() -> None:
    """The extras (transformers, matplotlib, the test tools) made unimportable: --help of every subcommand works,
    and a feature that needs an extra says which install command brings it, in one line."""
    script = textwrap.dedent("""
        import sys
        class Block:
            EXTRAS = {"transformers", "matplotlib", "openai", "pytest", "accelerate"}
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in self.EXTRAS:
                    raise ImportError(f"{name} is blocked (not in the base install)")
        sys.meta_path.insert(0, Block())
        from nexttoken.cli import build_parser, main
        subcommands = build_parser()._subparsers._group_actions[0].choices
        for name in subcommands:
            try:
                main([name, "--help"])
            except SystemExit as e:
                assert e.code == 0, (name, e.code)
        print("ok", sorted(subcommands))
        from nexttoken.extras import require
        try:
            require("matplotlib", "bench", "plots")
        except ImportError as e:
            print("message:", e)
    """)
    r = _run([sys.executable, "-c", script])
    assert r.returncode == 0, r.stderr
    assert "ok ['bench', 'chat', 'generate', 'loadtest', 'replay', 'run-batch', 'serve']" in r.stdout
    assert "pip install 'nexttoken[bench]'" in r.stdout


def test_generation_without_the_native_kernel_falls_back_cleanly(shared_dir: Path) -> None:
    """NEXTTOKEN_NATIVE=0 stands for a CPU without AVX-512: the torch path still gives llama2.c's greedy story."""
    run = json.loads((shared_dir / "reference" / "stories260k_llama2c_greedy.json").read_text())["runs"][0]
    cmd = [sys.executable, "-m", "nexttoken.cli", "generate", "--model", str(shared_dir / "models" / "stories260k"),
           "--max-new-tokens", "40", "--json"]
    fallback = subprocess.run(cmd, input=run["prompt"], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "NEXTTOKEN_NATIVE": "0", "NEXTTOKEN_REQUIRE_NATIVE": "0"})
    assert fallback.returncode == 0, fallback.stderr
    out = json.loads(fallback.stdout)
    assert out["prompt_token_ids"] == run["prompt_ids"]
    assert out["token_ids"] == run["ids"][len(run["prompt_ids"]):][:40]


def test_a_kernel_that_does_not_compile_is_an_error_where_required(tmp_path: Path) -> None:
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++;\n")
    script = textwrap.dedent(f"""
        from pathlib import Path
        from nexttoken.model import kernels
        kernels.SOURCES = (Path({str(broken)!r}),)
        try:
            print("available:", kernels.available())
        except kernels.NativeKernelError as e:
            print("error:", e)
    """)
    env = {"NEXTTOKEN_CACHE": str(tmp_path / "cache")}
    required = _run([sys.executable, "-c", script], {**env, "NEXTTOKEN_REQUIRE_NATIVE": "1"})
    assert "error: NEXTTOKEN_REQUIRE_NATIVE=1" in required.stdout and "build failed" in required.stdout, required
    optional = _run([sys.executable, "-c", script], {**env, "NEXTTOKEN_REQUIRE_NATIVE": "0"})
    assert "available: False" in optional.stdout, optional


def test_the_kernel_is_there_exactly_where_the_machine_can_build_it() -> None:
    """g++ and AVX-512 here: the kernel must be available (CI also sets NEXTTOKEN_REQUIRE_NATIVE=1, so a build
    failure is an error at the first use, not a skip); neither: the torch path, without error."""
    assert kernels.available() == MACHINE_CAN_BUILD
