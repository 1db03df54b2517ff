"""Process groups and parallel layout (megatron-core parallel_state) from any launcher environment."""
from .state import DistributedEnv, discover_launcher_env, initialize, is_main_process, shutdown

__all__ = ["DistributedEnv", "discover_launcher_env", "initialize", "shutdown", "is_main_process"]
