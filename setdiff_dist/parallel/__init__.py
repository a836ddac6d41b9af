"""Process groups and megatron-core parallel state (plus the CPU compatibility layer)."""

from .state import (
                    LaunchEnv,
                    LaunchError,
                    destroy_model_parallel,
                    first_host,
                    free_port,
                    init_distributed,
                    initialize_model_parallel,
                    launch_env,
                    megatron_groups,
)

__all__ = ["LaunchEnv", "LaunchError", "destroy_model_parallel", "first_host", "free_port",
           "init_distributed", "initialize_model_parallel", "launch_env", "megatron_groups"]
