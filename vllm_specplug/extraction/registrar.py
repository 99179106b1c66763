"""Registers our KV connectors with vLLM's `KVConnectorFactory` (general plugin).

The front end validates `kv_transfer_config` by importing the connector class,
so the registration has to happen in every process, before any config is built.
"""
from __future__ import annotations

# Named here, not imported: the plugin must stay cheap to import.
CONNECTOR_NAME = "SpecplugHiddenStatesConnector"

CONNECTORS = {CONNECTOR_NAME: ("vllm_specplug.extraction.connector", CONNECTOR_NAME)}


def register_connectors() -> list[str]:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    added = []
    for name, (module_path, class_name) in CONNECTORS.items():
        # The factory raises on a second registration of a name.
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, module_path, class_name)
            added.append(f"kv_connector:{name}")
    return added
