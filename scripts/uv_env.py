"""The machine's pip configuration as uv's environment variables, printed as `export` lines for
scripts/setup.sh to eval. uv reads UV_* variables and its own uv.toml, never pip.conf, so without
this a machine whose pip is set up (a local wheel folder, a mirror, a CA bundle) would be
ignored by uv. A UV_* variable already set wins over what pip says.

Usage: python scripts/uv_env.py   (reads `python -m pip config list`)
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Mapping

# pip option -> (uv variable, separator of its list; None: a single value). pip's list options
# are whitespace-separated in pip.conf and PIP_* variables.
PIP_TO_UV = {
    "index-url": ("UV_DEFAULT_INDEX", None),
    "extra-index-url": ("UV_INDEX", " "),
    "find-links": ("UV_FIND_LINKS", ","),
    "constraint": ("UV_CONSTRAINT", " "),
    "trusted-host": ("UV_INSECURE_HOST", " "),
    "cert": ("SSL_CERT_FILE", None),
    "client-cert": ("SSL_CLIENT_CERT", None),
    "timeout": ("UV_HTTP_TIMEOUT", None),
    "default-timeout": ("UV_HTTP_TIMEOUT", None),
    "no-index": ("UV_NO_INDEX", None),
}

# Where a value comes from, least binding first: pip's [global] section, then [install], then
# the PIP_* environment (`pip config list` names the last ":env:").
SCOPES = ("global", "install", ":env:")


def parse_pip_config(listing: str) -> dict[str, str]:
    """`pip config list` lines (`global.find-links='/opt/wheels'`) -> {option: value}, the
    most binding scope winning."""
    found: dict[tuple[int, str], str] = {}
    for line in listing.splitlines():
        name, sep, quoted = line.partition("=")
        scope, dot, option = name.rpartition(".")
        if not sep or not dot or scope not in SCOPES:
            continue
        words = shlex.split(quoted)
        found[(SCOPES.index(scope), option)] = words[0] if words else ""
    return {option: value for (_, option), value in sorted(found.items())}


def uv_environment(pip_options: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """uv's variables for pip's options; those set in `environ` already are left alone."""
    wanted: dict[str, str] = {}
    for option, value in pip_options.items():
        if option not in PIP_TO_UV or not value:
            continue
        variable, separator = PIP_TO_UV[option]
        wanted[variable] = separator.join(value.split()) if separator else value
    if "UV_INDEX" in wanted:
        # pip picks the best version across all its indexes; uv's default takes the first index
        # that has the package at all (a mirror holding an older release would then win).
        wanted["UV_INDEX_STRATEGY"] = "unsafe-best-match"
    return {k: v for k, v in wanted.items() if k not in environ}


def main() -> None:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    for variable, value in uv_environment(parse_pip_config(listing), os.environ).items():
        print(f"export {variable}={shlex.quote(value)}")


if __name__ == "__main__":
    main()
