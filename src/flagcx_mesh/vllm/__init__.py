"""vLLM disaggregated prefill/decode on flagcx_mesh agents (docs/vllm.md).

``FlagcxMeshConnector`` (a vLLM 0.33 ``KVConnectorBase_V1``) loads with::

    --kv-transfer-config '{"kv_connector": "FlagcxMeshConnector",
                           "kv_connector_module_path": "flagcx_mesh.vllm", "kv_role": "kv_both"}'

The transfer part (``flagcx_mesh.vllm.transfer``, ``.layout``, ``.protocol``) imports without
vLLM; only the connector classes (``flagcx_mesh.vllm.connector``) need it, and they are loaded
on first use of the names below.
"""

_CONNECTOR_NAMES = ("FlagcxMeshConnector", "FlagcxMeshConnectorMetadata", "FlagcxMeshHandshake")

__all__ = list(_CONNECTOR_NAMES)


def __getattr__(name):
    if name in _CONNECTOR_NAMES:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
