"""`vllm-specplug check`: is the plugin installed and loadable by vLLM?"""
from __future__ import annotations

from importlib.metadata import entry_points


def add_parser(sub) -> None:
    parser = sub.add_parser("check", help="verify the plugin's entry point and "
                            "vLLM version, and register it in this process")
    parser.set_defaults(func=run)


def run(args) -> int:
    names = [ep.value for ep in entry_points(group="vllm.general_plugins")
             if ep.name == "vllm_specplug"]
    if not names:
        print("entry point vllm.general_plugins:vllm_specplug is missing; "
              "reinstall with `pip install -e .`")
        return 1
    from vllm_specplug.plugin import register, registration_state

    register()
    state = registration_state()
    print(f"entry point: {names[0]}")
    print(f"vLLM {state['vllm_version']}: registered "
          f"{', '.join(state['items']) or 'no extensions yet'}")
    return 0
