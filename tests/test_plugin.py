"""The plugin's entry point, version gate, registration and patch registry."""
from __future__ import annotations

import importlib
import os
from importlib.metadata import entry_points

import pytest

from vllm_specplug import plugin
from vllm_specplug.patches.registry import PatchConflict, PatchRegistry
from vllm_specplug.version_gate import UnsupportedVLLMVersion, check_vllm_version


def test_entry_point_is_installed():
    found = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert found.get("vllm_specplug") == "vllm_specplug.plugin:register"


@pytest.mark.parametrize("version", ["0.32.0", "0.32.7", "0.32.0+cpu"])
def test_version_gate_accepts_supported(version):
    assert check_vllm_version(version).release[:2] == (0, 32)


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "1.0.0", "0.33.0rc1", "banana"])
def test_version_gate_refuses_with_range(version):
    with pytest.raises(UnsupportedVLLMVersion, match=r">=0\.32\.0,<0\.33\.0"):
        check_vllm_version(version)


_CALLS: list[int] = []


def _counting_registrar():
    _CALLS.append(1)
    return ["x"]


def test_register_is_idempotent(monkeypatch):
    monkeypatch.setattr(plugin, "_STATE", plugin.RegistrationState())
    monkeypatch.setattr(plugin, "REGISTRARS", ("tests.test_plugin:_counting_registrar",))
    _CALLS.clear()
    plugin.register()
    plugin.register()
    state = plugin.registration_state()
    assert _CALLS == [1]
    assert state["registered"] and state["items"] == ["x"] and state["pid"] == os.getpid()


def _failing_registrar():
    raise ValueError("bad proposer entry point")


def test_register_failure_is_recorded_and_raised(monkeypatch):
    monkeypatch.setattr(plugin, "_STATE", plugin.RegistrationState())
    monkeypatch.setattr(plugin, "REGISTRARS", ("tests.test_plugin:_failing_registrar",))
    with pytest.raises(ValueError, match="bad proposer"):
        plugin.register()
    state = plugin.registration_state()
    assert not state["registered"]
    assert "bad proposer entry point" in state["error"]


class _Target:
    def method(self):
        return "original"


def test_patch_registry_patches_once_and_reverts():
    registry = PatchRegistry()
    registry.apply(_Target, "method", lambda self: "patched", reason="test")
    assert _Target().method() == "patched"
    with pytest.raises(PatchConflict, match="already patched"):
        registry.apply(_Target, "method", lambda self: "again", reason="twice")
    assert [r.target for r in registry.applied()] == [
        f"{__name__}._Target.method"]
    registry.revert(_Target, "method")
    assert _Target().method() == "original" and registry.applied() == []


def test_patch_registry_refuses_other_vllm_and_missing_attr():
    registry = PatchRegistry()
    with pytest.raises(UnsupportedVLLMVersion):
        registry.apply(_Target, "method", None, reason="x", vllm_version="0.40.0")
    with pytest.raises(PatchConflict, match="does not exist"):
        registry.apply(_Target, "no_such", None, reason="x")
    assert _Target().method() == "original"


def test_plugin_registered_inside_engine_worker(baseline_llm):
    """vLLM only logs a plugin's exception: ask the worker process itself."""
    import vllm

    states = baseline_llm.collective_rpc("specplug_registration_state")
    assert states, "no worker answered"
    for state in states:
        assert state["error"] is None
        assert state["registered"] is True
        assert state["vllm_version"] == vllm.__version__
        assert state["pid"] != os.getpid(), "probe ran in the test process"


def test_when_imported_patches_at_first_import(tmp_path, monkeypatch):
    from vllm_specplug.patches.lazy import when_imported

    (tmp_path / "specplug_lazy_target.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    assert when_imported("specplug_lazy_target", lambda: seen.append(
        __import__("specplug_lazy_target").VALUE)) == "on import"
    assert seen == []
    importlib.import_module("specplug_lazy_target")
    assert seen == [1]
    assert when_imported("specplug_lazy_target", lambda: seen.append(2)) == "now"
    assert seen == [1, 2]
