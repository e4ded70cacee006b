"""`make setup`'s bridge from pip's configuration to uv (scripts/uv_flags.py)."""

import importlib.util
import subprocess
import sys

from tests.helpers import ROOT

_spec = importlib.util.spec_from_file_location("uv_flags", ROOT / "scripts" / "uv_flags.py")
uv_flags = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(uv_flags)

LISTING = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.find-links='/opt/wheels'
global.cert='/etc/pip-ca.pem'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.index-url='https://mirror.example/simple'
global.timeout='60'
"""


def test_pips_sources_become_uv_flags_in_pips_order():
    found = uv_flags.settings(LISTING)
    assert found["cert"] == ["/etc/ssl/certs/ca-certificates.crt"]  # PIP_CERT beats the file
    assert found["find-links"] == ["/opt/wheels"]
    assert uv_flags.flags(found) == [
        "--index-url", "https://mirror.example/simple",
        "--extra-index-url", "file:///opt/pypi/simple",
        "--extra-index-url", "file:///opt/pypi-more/simple",
        "--find-links", "/opt/wheels",
        "--constraint", "/etc/xdg/pip/constraints.txt",
    ]  # fmt: skip


def test_no_pip_configuration_gives_no_flags_and_no_cert():
    assert uv_flags.flags(uv_flags.settings("")) == []
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "uv_flags.py")],
        env={"PIP_CONFIG_FILE": "/dev/null", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out == ["", "cert="]
