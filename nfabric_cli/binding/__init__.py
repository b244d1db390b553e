"""Bindings: an operating profile resolved against a real model (parameter -> route per
phase), with DDP's bucket plan, capacity verdicts and modelled traffic."""

from nfabric_cli.binding.bindings import Bindings, BucketPlan, ParamBinding
from nfabric_cli.binding.buckets import bucket_caps, plan_buckets, trace_ready_order
from nfabric_cli.binding.compile import compile_profile
from nfabric_cli.binding.fingerprint import model_fingerprint, trainable_parameters
from nfabric_cli.binding.selectors import select, selector_matches
from nfabric_cli.binding.static import on_route, parse_rule, static_profile
from nfabric_cli.binding.store import load_bindings_or_profile, read_bindings, write_bindings

__all__ = [
    "Bindings",
    "BucketPlan",
    "ParamBinding",
    "bucket_caps",
    "compile_profile",
    "load_bindings_or_profile",
    "model_fingerprint",
    "parse_rule",
    "plan_buckets",
    "read_bindings",
    "select",
    "selector_matches",
    "on_route",
    "static_profile",
    "trace_ready_order",
    "trainable_parameters",
    "write_bindings",
]
