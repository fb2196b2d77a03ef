"""Stand-ins for torch's private RPC names that compat does not provide.

torch's own test modules import private names at load time (``from
torch.distributed.rpc.internal import PythonUDF``).  A module's ``__getattr__``
returns an :class:`Unsupported` for such a name, so the import succeeds and only
a use of the name fails, with a clear error, instead of the whole module.
"""

from __future__ import annotations

from typing import Any, NoReturn


class Unsupported:
    """A private torch name asyncrpc.compat does not provide: any use raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def _refuse(self) -> NoReturn:
        raise NotImplementedError(
            f"{self._name} is a private torch.distributed API that asyncrpc.compat does not provide"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse()

    def __getattr__(self, attribute: str) -> Unsupported:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return Unsupported(f"{self._name}.{attribute}")

    def __enter__(self) -> NoReturn:
        self._refuse()

    def __exit__(self, *exc: object) -> None:
        pass

    def __repr__(self) -> str:
        return f"<unsupported {self._name}>"


def private_getattr(module: str, every_name: bool = False) -> Any:
    """A module ``__getattr__``: private names (``every_name``: all names but dunders)
    become :class:`Unsupported`."""

    def __getattr__(name: str) -> Unsupported:  # noqa: N807  # the module hook
        if (every_name or name.startswith("_")) and not name.startswith("__"):
            return Unsupported(f"{module}.{name}")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
