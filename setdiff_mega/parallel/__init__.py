"""Process groups and parallel layout (megatron-core parallel_state) from any launcher environment."""
from .state import DistributedEnv, initialize, is_main_process, shutdown

__all__ = ["DistributedEnv", "initialize", "shutdown", "is_main_process"]
