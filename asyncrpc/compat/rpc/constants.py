"""torch.distributed.rpc.constants: the defaults, with torch's values and meanings."""

from datetime import timedelta

DEFAULT_RPC_TIMEOUT_SEC: float = 60.0
UNSET_RPC_TIMEOUT: float = -1.0  # a timeout argument left unset: the default applies
DEFAULT_INIT_METHOD: str = "env://"
DEFAULT_SHUTDOWN_TIMEOUT: float = 0  # 0: wait for the other workers as long as they live
DEFAULT_NUM_WORKER_THREADS: int = 16
DEFAULT_RPC_TIMEOUT: timedelta = timedelta(seconds=DEFAULT_RPC_TIMEOUT_SEC)
