"""The doorbell's gate (expert_service/doorbell.py): who may ring, and which regions it will map.

Against a real `splitmoe serve-experts` process: a connection must prove the cluster secret before
anything is mapped, and then may name only regions it created itself. The attack this stops: any
local user naming someone else's region (or a symlink to it) and having the service, running as
another user, write its output there. When the tests run as root, that user is a subprocess that
drops to uid 65534 (nobody) after importing what it needs.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import pytest

from splitmoe.attention_service.expert_backends.shm_link import HopFailed, ShmLink
from splitmoe.proto import doorbell, expert_pb2, expert_pb2_grpc
from splitmoe.proto.shm import SHM_DIR, ShmRegion
from tests.support.processes import CLUSTER, REPO, cluster_channel, free_port, grpc_service

pytestmark = [
    pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm"),
    pytest.mark.stack,  # a `serve-experts` process, and peers as other processes
]
NOBODY = 65534
REGION_BYTES = 4096


@pytest.fixture(scope="module")
def bell(demo_gguf, tmp_path_factory) -> str:
    """The doorbell address of a service run by this test's user (root, on these machines)."""
    port = free_port()
    args = ["serve-experts", str(demo_gguf), "--port", str(port), "--experts", "0-3", "--threads", "1"]
    with grpc_service(args, port, tmp_path_factory.mktemp("logs") / "experts.log"):
        with cluster_channel(f"127.0.0.1:{port}") as channel:
            info = expert_pb2_grpc.ExpertServiceStub(channel).DescribeShard(expert_pb2.DescribeShardRequest(), timeout=10)
        yield info.doorbell


def connect(address: str):
    sock = doorbell.new_socket()
    sock.settimeout(30)
    sock.connect(doorbell.socket_address(address))
    sock.send(doorbell.HELLO.pack(doorbell.KIND_HELLO, doorbell.VERSION, doorbell.MAGIC))
    answer = sock.recv(4096)
    assert doorbell.REPLY.unpack_from(answer)[:2] == (doorbell.KIND_HELLO, doorbell.STATUS_OK)
    return sock, answer[doorbell.REPLY.size:]


def zero_token_hop(announced: bytes) -> bytes:
    return doorbell.REQUEST.pack(doorbell.KIND_FORWARD, 1, 0, 0, 0, 1, 64, 1, len(announced), 0) + announced


def test_a_wrong_secret_is_refused_and_the_connection_closed(bell):
    sock, challenge = connect(bell)
    with sock:
        sock.send(doorbell.PROOF.pack(doorbell.KIND_PROOF, doorbell.proof("not-the-cluster-secret-0123", challenge)))
        answer = sock.recv(4096)
        assert doorbell.REPLY.unpack_from(answer)[:2] == (doorbell.KIND_PROOF, doorbell.STATUS_ERROR)
        assert b"wrong cluster secret" in answer
        assert sock.recv(4096) == b""


def test_nothing_is_mapped_for_a_connection_that_skips_the_proof(bell):
    region = ShmRegion.create(REGION_BYTES)
    sock, _ = connect(bell)
    try:
        sock.send(zero_token_hop(doorbell.announcement(region.name, region.num_bytes)))
        assert sock.recv(4096) == b""  # hung up: a hop before the proof is a protocol error
    finally:
        sock.close()
        region.close()


def test_the_attention_side_link_fails_cleanly_with_a_wrong_secret(bell):
    with pytest.raises(HopFailed, match="wrong cluster secret"):
        ShmLink(bell, "not-the-cluster-secret-0123", REGION_BYTES, 5.0, 5.0, lambda *_: None)
    link = ShmLink(bell, CLUSTER.token, REGION_BYTES, 5.0, 5.0, lambda *_: None)
    link.close()


# A peer as another user: it imports as root, then becomes nobody, then rings the bell as told on
# stdin. It reports, per region name, the status and error of a zero-token hop announcing it.
NOBODY_PEER = r"""
import json, os, sys
from splitmoe.proto import doorbell
from splitmoe.proto.shm import SHM_DIR
os.setgroups([]); os.setgid(NOBODY); os.setuid(NOBODY)
print(os.getpid(), flush=True)
job = json.loads(sys.stdin.readline())
own = SHM_DIR / f"splitmoe-{os.getpid()}-0a0a"              # a region of its own: the control
fd = os.open(own, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
os.ftruncate(fd, job["size"]); os.close(fd)
link = SHM_DIR / f"splitmoe-{os.getpid()}-1b1b"             # its own name, pointing at root's region
link.symlink_to(SHM_DIR / job["root_region"])
results = {}
try:
    for name in (own.name, job["root_region_in_its_name"], link.name):
        sock = doorbell.new_socket(); sock.settimeout(30)
        sock.connect(doorbell.socket_address(job["bell"]))
        sock.send(doorbell.HELLO.pack(doorbell.KIND_HELLO, doorbell.VERSION, doorbell.MAGIC))
        challenge = sock.recv(4096)[doorbell.REPLY.size:]
        sock.send(doorbell.PROOF.pack(doorbell.KIND_PROOF, doorbell.proof(job["token"], challenge)))
        assert doorbell.REPLY.unpack_from(sock.recv(4096))[1] == doorbell.STATUS_OK
        announced = doorbell.announcement(name, job["size"])
        sock.send(doorbell.REQUEST.pack(doorbell.KIND_FORWARD, 1, 0, 0, 0, 1, 64, 1, len(announced), 0) + announced)
        answer = sock.recv(4096)
        results[name] = [doorbell.REPLY.unpack_from(answer)[1], answer[doorbell.REPLY.size:].decode()]
        sock.close()
finally:
    own.unlink(); link.unlink()
print(json.dumps(results), flush=True)
"""


@pytest.mark.skipif(os.getuid() != 0, reason="a peer of another uid needs root to drop to it (these tests run "
                                             "as root on the CI machines)")
def test_a_peer_of_another_uid_cannot_have_root_regions_mapped_directly_or_through_a_symlink(bell):
    victims = []  # root's regions, 0600, filled with a pattern: none must change
    peer = subprocess.Popen([sys.executable, "-c", f"NOBODY = {NOBODY}\n" + NOBODY_PEER], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        peer_pid = int(peer.stdout.readline())
        root_region = ShmRegion.create(REGION_BYTES)  # root's own
        # root's region named as if the peer made it: only the owner check stands in the way
        in_its_name = SHM_DIR / f"splitmoe-{peer_pid}-{secrets.token_hex(4)}"
        fd = os.open(in_its_name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, REGION_BYTES)
        os.close(fd)
        victims = [SHM_DIR / root_region.name, in_its_name]
        for path in victims:
            path.write_bytes(b"\xab" * REGION_BYTES)
        job = {"bell": bell, "token": CLUSTER.token, "size": REGION_BYTES, "root_region": root_region.name,
               "root_region_in_its_name": in_its_name.name}
        out, err = peer.communicate(json.dumps(job) + "\n", timeout=60)
        assert peer.returncode == 0, err
        results = json.loads(out)
        assert all(path.read_bytes() == b"\xab" * REGION_BYTES for path in victims)
    finally:
        peer.kill()
        for path in victims[1:]:
            path.unlink(missing_ok=True)
        if victims:
            root_region.close()
    control, in_its_name_result, through_link = results.values()
    assert control == [doorbell.STATUS_OK, ""]  # the peer's own region maps: the setup works
    assert in_its_name_result[0] == doorbell.STATUS_ERROR
    assert f"owned by uid 0, not by the peer (uid {NOBODY})" in in_its_name_result[1]
    assert through_link[0] == doorbell.STATUS_ERROR and "symbolic link" in through_link[1]
