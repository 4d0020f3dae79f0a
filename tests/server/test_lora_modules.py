"""The served adapters' registry without a server: JAXLLM_LORA_MODULES in both forms, --lora-modules onto it, names
and ids, runtime paths kept inside JAXLLM_LORA_ROOTS, and an adapter refused by the real check leaving nothing
registered."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxllm.cli import build_parser
from jaxllm.cli.serve import environment
from jaxllm.lora.adapter import load_adapter
from jaxllm.lora.spec import LoRASpec
from server.lora_modules import LoRAModule, LoRAModuleError, LoRARegistry, parse_lora_modules
from server.settings import ServerSettings

SPEC = LoRASpec(max_rank=8, num_layers=2, shapes={"q_proj": (16, 32), "v_proj": (8, 32)})


def _adapter(folder, r=4):
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    save_file({f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{ab}.weight":
               rng.standard_normal(shape).astype(np.float32)
               for i in range(2) for ab, shape in (("A", (r, 32)), ("B", (16, r)))},
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"r": r, "lora_alpha": r, "target_modules": ["q_proj"]}))
    return folder


def _registry(roots=()):
    return LoRARegistry("base", lambda req: load_adapter(req.lora_name, req.lora_path, SPEC), roots=roots,
                        allow_runtime=True)


def test_both_forms_of_the_modules_variable():
    assert parse_lora_modules("a=/x, b=/y/z") == (LoRAModule("a", "/x"), LoRAModule("b", "/y/z"))
    assert parse_lora_modules('[{"name": "a", "path": "/x", "base_model_name": "m"}]') == (LoRAModule("a", "/x", "m"),)
    assert parse_lora_modules('{"name": "a", "path": "/x"}') == (LoRAModule("a", "/x"),)
    assert parse_lora_modules("") == ()
    for bad, message in (("a", "expected name=path"), ("a=/x,a=/y", "given twice"), ("[1]", "expected objects"),
                         ('{"name": "a"}', "expected objects"), ("[{", "not valid JSON")):
        with pytest.raises(ValueError, match=message):
            parse_lora_modules(bad)


def test_flags_and_variables_turn_lora_on():
    args = build_parser().parse_args(["serve", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}',
                                      "--max-loras", "3", "--max-lora-rank", "32"])
    env, _ = environment(args, {})
    assert json.loads(env["JAXLLM_LORA_MODULES"]) == [{"name": "a", "path": "/x"}, {"name": "b", "path": "/y"}]
    s = ServerSettings.from_env(env)
    assert s.lora_modules == (LoRAModule("a", "/x"), LoRAModule("b", "/y"))
    assert (s.engine.enable_lora, s.engine.max_loras, s.engine.max_lora_rank) == (True, 3, 32)
    env, _ = environment(build_parser().parse_args(["serve", "--lora-modules", "a=/x", "b=/y"]), {})
    assert env["JAXLLM_LORA_MODULES"] == "a=/x,b=/y"
    assert not ServerSettings.from_env({}).engine.enable_lora
    with pytest.raises(ValueError, match="JAXLLM_ENABLE_LORA=false"):
        ServerSettings.from_env({"JAXLLM_LORA_MODULES": "a=/x", "JAXLLM_ENABLE_LORA": "false"})
    with pytest.raises(ValueError, match="needs one API server"):
        ServerSettings.from_env({"JAXLLM_ALLOW_RUNTIME_LORA_UPDATING": "true", "JAXLLM_API_SERVERS": "2"})


def test_ids_are_fresh_and_a_refused_adapter_leaves_nothing(tmp_path):
    reg = _registry()
    first = reg.prepare("a", str(_adapter(tmp_path / "a")), False)
    reg.add(first)
    with pytest.raises(LoRAModuleError, match="rank 16 is above max_lora_rank 8"):
        reg.prepare("big", str(_adapter(tmp_path / "big", r=16)), True)
    with pytest.raises(LoRAModuleError, match="already loaded"):
        reg.prepare("a", str(tmp_path / "a"), True)
    with pytest.raises(LoRAModuleError, match="the base model's"):
        reg.prepare("base", str(tmp_path / "a"), True)
    for name in ("", "a b", "../x", "x" * 200):
        with pytest.raises(LoRAModuleError, match="letters, digits") as e:
            reg.prepare(name, str(tmp_path / "a"), True)
        assert e.value.param == "lora_name"
    again = reg.prepare("a", str(tmp_path / "a"), True, True)  # replacing: a new id, never the old one
    assert [r.lora_name for r in reg] == ["a"] and again.lora_int_id > first.lora_int_id
    reg.remove("a")
    with pytest.raises(LoRAModuleError, match="not loaded") as e:
        reg.remove("a")
    assert e.value.status == 404 and len(reg) == 0


def test_runtime_paths_stay_inside_the_roots(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    _adapter(root / "a")
    _adapter(outside)
    os.symlink(outside, root / "link")
    (tmp_path / "rootx").mkdir()  # a sibling whose name starts with the root's
    _adapter(tmp_path / "rootx" / "b")
    reg = _registry(roots=(str(root),))
    assert reg.prepare("a", str(root / "sub" / ".." / "a"), True).lora_path == str(root / "a")
    for path in (root / ".." / "outside", root / "link", tmp_path / "rootx" / "b"):
        with pytest.raises(LoRAModuleError, match="outside the folders"):
            reg.prepare("x", str(path), True)
    assert reg.prepare("x", str(outside), False).lora_path == str(outside)  # the operator's own modules: any path
