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

