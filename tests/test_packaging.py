"""A non-editable install works outside the checkout: the wheel carries the presets (package data) and the CLI
runs the embedded model with the default preset."""

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_installed_outside_the_checkout_runs_the_cli(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(ROOT)],
                   check=True, cwd=tmp_path)
    (wheel,) = wheels.glob("jaxllm-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    # The dependencies come from this environment's site-packages, appended after the new venv's own (a plain
    # path line: this environment's editable-install hooks are not run, so only the wheel provides jaxllm).
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "outer_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    where = subprocess.run([py, "-c", "import jaxllm, server, pallas_kernels; from jaxllm.engine.config import "
                            "preset_names; print(jaxllm.__file__, server.__file__, preset_names())"],
                           capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert str(venv) in where and str(ROOT) not in where, where
    assert "smollm2-cpu" in where and "llama-3.1-8b-h100" in where
    run = subprocess.run([py, "-m", "jaxllm.generate", "--max-tokens", "4", "What is the capital of France?"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[SmolLM2-135M-Instruct] prompt tokens:" in run.stderr and run.stdout.strip(), run.stderr[-2000:]
    # the jaxllm command and the server's gunicorn settings come with the wheel
    run = subprocess.run([str(venv / "bin" / "jaxllm"), "serve", "--help"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert run.returncode == 0 and "--tensor-parallel-size" in run.stdout, run.stderr[-2000:]
    conf = subprocess.run([py, "-c", "import server.gunicorn_config as c; print(c.__file__, c.worker_class)"],
                          capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert str(venv) in conf and "gevent" in conf
