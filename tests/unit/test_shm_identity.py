"""Which members a shared-memory group accepts as one host (phalanx.shm.segment)."""

from phalanx.shm.segment import _usable, identity


def test_members_must_agree_on_host_boot_and_namespaces():
    me = identity()
    assert _usable([me, dict(me)]) == (me["machine"] in ("x86_64", "AMD64") and me["memfd"]
                                       and bool(me["boot"]) and me["pid_ns"] != -1)
    for key, other in (("host", "elsewhere"), ("boot", "another-boot"), ("pid_ns", 1),
                       ("net_ns", 1)):  # another network namespace counts as another host
        assert not _usable([me, {**me, key: other}]), key
    assert not _usable([{**me, "machine": "aarch64"}] * 2)  # the ordering argument is x86's
