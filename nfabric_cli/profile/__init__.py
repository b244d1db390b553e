"""Operating profiles: the rows (region x phase -> route), their metadata, the versioned
Parquet store and the semantic diff CI gates on."""

from nfabric_cli.profile.diff import ProfileDiff, diff_profiles
from nfabric_cli.profile.operating import OperatingProfile, ProfileRow
from nfabric_cli.profile.phases import Phase, parse_phases, phase_at
from nfabric_cli.profile.schema import SCHEMA_VERSION
from nfabric_cli.profile.store import (
    next_profile_path,
    read_profile,
    resolve_profile,
    write_next_version,
    write_profile,
)

__all__ = [
    "SCHEMA_VERSION",
    "OperatingProfile",
    "Phase",
    "ProfileDiff",
    "ProfileRow",
    "diff_profiles",
    "next_profile_path",
    "parse_phases",
    "phase_at",
    "read_profile",
    "resolve_profile",
    "write_next_version",
    "write_profile",
]
