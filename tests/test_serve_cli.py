"""`kestrel serve` flags that are refused or warned about before any weights load, API key sources, and the Host
header rules for each kind of bind address."""

import logging
import socket

import pytest

import serve_helpers as H
from kestrel.cli import main
from kestrel.serve.security import HostCheck, check_bearer, host_of


def run(capsys, *argv):
    rc = main(["serve", "--model", H.model_dir(), "--port", "0", *argv])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--api-key", ""], "--api-key is empty"),
    (["--api-key", "good", "--api-key", "  "], "--api-key is empty"),
    (["--api-key", "two words"], "an API key contains whitespace"),
    (["--max-request-bytes", "0"], "--max-request-bytes 0"),
    (["--max-choices", "-1"], "--max-choices -1"),
    (["--max-request-tokens", "0"], "--max-request-tokens 0"),
    (["--body-timeout", "0"], "--body-timeout 0"),
    (["--header-timeout", "nan"], "--header-timeout nan"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout -1"),
])
def test_bad_flags_are_one_line_errors_before_loading(capsys, caplog, argv, message):
    with caplog.at_level(logging.INFO):
        rc, err = run(capsys, *argv)
    assert rc == 2 and f"kestrel: error: {message}" in err and "Traceback" not in err
    assert not any("loading" in r.getMessage() for r in caplog.records)


def test_empty_key_from_the_environment_is_an_error(capsys, monkeypatch):
    monkeypatch.setenv("KESTREL_API_KEY", "")
    rc, err = run(capsys)
    assert rc == 2 and "$KESTREL_API_KEY is empty" in err


def test_key_file(tmp_path, capsys):
    import argparse

    from kestrel.serve.cli import api_keys
    f = tmp_path / "keys"
    f.write_text("# team keys\n\nalpha\n  beta  \nalpha\n")
    args = argparse.Namespace(api_key=["gamma"], api_key_file=str(f))
    assert api_keys(args) == ("gamma", "alpha", "beta")
    f.write_text("# nothing\n\n")
    rc, err = run(capsys, "--api-key-file", str(f))
    assert rc == 2 and "has no keys" in err
    rc, err = run(capsys, "--api-key-file", str(tmp_path / "missing"))
    assert rc == 2 and "cannot read it" in err


def test_open_bind_without_a_key_warns(capsys, caplog):
    # 192.0.2.1 (TEST-NET) is not this machine: the warning comes, then binding fails, before any weights load
    with caplog.at_level(logging.WARNING, logger="kestrel.serve"):
        rc, err = run(capsys, "--host", "192.0.2.1")
    assert rc == 2 and "cannot listen there" in err
    assert any("without an API key" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kestrel.serve"):
        run(capsys, "--host", "192.0.2.1", "--api-key", "k")
    assert not any("without an API key" in r.getMessage() for r in caplog.records)


def test_host_rules():
    loop = HostCheck.for_bind("127.0.0.1", "127.0.0.1")
    for ok in (b"127.0.0.1:8000", b"localhost", b"LocalHost:1", b"[::1]:8000", b"localhost."):
        assert loop.refuse([ok]) is None, ok
    for bad in (b"evil.example", b"10.0.0.1", b"127.0.0.2", b"localhost.evil.example", b""):
        assert loop.refuse([bad]) is not None, bad
    assert loop.refuse([]) is not None and loop.refuse([b"localhost", b"localhost"]) is not None
    lan = HostCheck.for_bind("10.1.2.3", "10.1.2.3", ["api.example", "other.example"])
    assert lan.refuse([b"10.1.2.3:80"]) is None and lan.refuse([b"api.example"]) is None
    assert lan.refuse([b"localhost"]) is not None and lan.refuse([b"10.1.2.4"]) is not None
    wild = HostCheck.for_bind("0.0.0.0", "0.0.0.0")
    assert wild.refuse([b"192.168.7.7:8000"]) is None and wild.refuse([b"[fe80::1]"]) is None
    assert wild.refuse([socket.gethostname().encode()]) is None and wild.refuse([b"evil.example"]) is not None
    assert HostCheck.for_bind("127.0.0.1", "127.0.0.1", ["*"]) is None
    assert host_of(b"[::1]:80") == "::1" and host_of(b"Example.COM.:443") == "example.com"


def test_bearer_rules():
    keys = (b"alpha", b"beta")
    assert check_bearer(b"Bearer beta", keys) is None and check_bearer(b"bEaReR alpha", keys) is None
    for bad in (None, b"", b"Bearer", b"Bearer alph", b"Token alpha", b"alpha"):
        assert check_bearer(bad, keys) is not None, bad
