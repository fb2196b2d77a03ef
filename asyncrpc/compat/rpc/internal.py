"""torch.distributed.rpc.internal: private in torch; every name here is unsupported."""

from asyncrpc.compat._private import private_getattr

__getattr__ = private_getattr("torch.distributed.rpc.internal", every_name=True)


def __dir__() -> list[str]:
    return []
