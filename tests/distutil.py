"""Run a function on N real gloo ranks: the ground floor's runner (`nfabric_cli.ranks`)."""

from nfabric_cli.ranks.functions import run_function_ranks as run_ranks

__all__ = ["run_ranks"]
