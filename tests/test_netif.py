"""How a node finds its own address and interface towards the rendezvous host (trainer.launch.netif)."""

import sys

import pytest

from tests import netns
from tests.helpers import ROOT, env
from trainer.launch import netif

INTERFACES = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.8.1.17", "fe80::1"], "ib0": ["192.168.5.2"]}


@pytest.mark.parametrize(
    "address, name",
    [
        ("10.8.1.17", "eth0"),
        ("192.168.5.2", "ib0"),
        ("127.0.0.1", "lo"),
        ("127.0.0.2", "lo"),  # any loopback address is the loopback interface's
        ("fe80::1%eth0", "eth0"),
        ("10.9.9.9", None),
        ("not-an-ip", None),
    ],
)
def test_interface_for_owning_address(address, name):
    assert netif.interface_for(address, INTERFACES) == name


def test_this_machine_reaches_loopback_over_lo():
    addr = netif.source_address("127.0.0.1", 29500)
    assert addr == "127.0.0.1"
    assert netif.interface_for(addr, netif.interface_addresses()) == "lo"


def test_unresolvable_host_is_an_oserror():
    with pytest.raises(OSError):
        netif.source_address("no-such-host.invalid", 29500)


@pytest.mark.netns
def test_each_namespace_node_reaches_node0_from_its_own_eth0():
    if reason := netns.unavailable():
        pytest.skip(reason)
    probe = (
        "from trainer.launch import netif; a = netif.source_address('node0', 29500); "
        "print(a, netif.interface_for(a, netif.interface_addresses()))"
    )
    with netns.Network(2, hosts={"node0": 0}) as net:
        for i, node in enumerate(net.nodes):
            p = net.run(
                i,
                [sys.executable, "-c", probe],
                env=env(),
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert p.returncode == 0, p.stderr
            # node 0 is MASTER_ADDR itself: still its eth0 address, not loopback
            assert p.stdout.split() == [node.ip, "eth0"]
