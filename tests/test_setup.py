"""`make setup`'s bridge from pip's configuration to uv (scripts/uv_flags.py)."""

import importlib.util
import os
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


def test_the_venv_holds_compiled_bytecode_for_torch():
    """`make setup` compiles the lock's modules once (uv's --compile-bytecode, as pip does). Where
    PYTHONDONTWRITEBYTECODE is set, as on CI, a venv without them makes every process compile
    torch again: 6.0 s to import instead of 3.2 s, and the suite twice as long."""
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin is not None
    cached = importlib.util.cache_from_source(spec.origin)
    assert os.path.isfile(cached), f"no {cached}: rebuild the venv (rm -rf .venv; make setup)"
