"""Command-line entry points."""


def with_clean_shutdown(main):
    """The console-script entry of a command that joins a process group: run ``main``, then
    take the groups down cleanly (a gloo group left to the interpreter's exit can abort the
    process in its destructor)."""

    def entry(argv=None) -> int:
        try:
            return main(argv)
        finally:
            from setdiff_dist.parallel import destroy_model_parallel

            destroy_model_parallel()

    return entry


def add_dtype_argument(ap) -> None:
    """``--dtype``, for the commands that load a model for inference."""
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="the weights' and activations' dtype: auto = bfloat16 on a GPU, "
                         "float32 on the CPU")


def inference_dtype(name: str):
    import torch

    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, name)

