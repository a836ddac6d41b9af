"""The set-diffusion transformer (megatron-core layers) and its pure-torch reference."""
