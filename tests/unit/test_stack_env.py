"""The stack's child environment: compile caches shared across data dirs, the venv's tools first."""

import os
import sys
from pathlib import Path

from seamlessflow.stack.processes import compile_caches, venv_first


def test_compile_caches_follow_sf_cache_dir_not_the_data_dir(tmp_path):
    caches = compile_caches({"SF_CACHE_DIR": str(tmp_path / "c")})
    assert caches == {"VLLM_CACHE_ROOT": str(tmp_path / "c" / "vllm"),
                      "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "c" / "inductor"),
                      "TORCH_EXTENSIONS_DIR": str(tmp_path / "c" / "torch_extensions")}


def test_compile_caches_default_to_the_users_cache(tmp_path):
    assert compile_caches({"XDG_CACHE_HOME": str(tmp_path)})["TORCH_EXTENSIONS_DIR"] == \
        str(tmp_path / "seamlessflow" / "torch_extensions")
    assert compile_caches({})["VLLM_CACHE_ROOT"] == str(Path.home() / ".cache" / "seamlessflow" / "vllm")


def test_venv_first_puts_this_interpreters_bin_first_once():
    venv_bin = str(Path(sys.executable).parent)
    got = venv_first(os.pathsep.join(["/usr/bin", venv_bin, "/bin"])).split(os.pathsep)
    assert got == [venv_bin, "/usr/bin", "/bin"]
    assert venv_first("").split(os.pathsep) == [venv_bin]
