"""attention_service/expert_backends/membership.py: what a round finds (the processes' test is
tests/test_membership_stack.py). Members here are plain records of what the round reads of a client."""
from dataclasses import dataclass

from splitmoe.attention_service.expert_backends.membership import MISSING_ROUNDS, Candidate, Membership


@dataclass
class Member:
    address: str
    server_name: str = ""
    draining: bool = False
    instance_id: str = ""
    healthy: bool = True


def membership(tmp_path, members, lines, addresses=("experts:7000",)):
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(f"{ip} experts\n" for ip in lines))
    return Membership(addresses, lambda: members, lambda change: None, 1.0, str(hosts)), hosts


def test_a_name_resolving_to_one_more_address_brings_a_candidate(tmp_path):
    members = [Member("10.0.0.1:7000", "experts"), Member("10.0.0.2:7000", "experts")]
    m, hosts = membership(tmp_path, members, ["10.0.0.1", "10.0.0.2"])
    assert not m.find_changes()
    hosts.write_text(hosts.read_text() + "10.0.0.3 experts\n")
    change = m.find_changes()
    assert change.joining == (Candidate("10.0.0.3:7000", "experts"),) and not change.leaving


def test_an_address_gone_from_its_name_leaves_after_two_rounds_and_an_empty_answer_changes_nothing(tmp_path):
    members = [Member("10.0.0.1:7000", "experts"), Member("10.0.0.2:7000", "experts"),
               Member("10.0.0.9:7000", "10.0.0.9")]  # given as an IP: only its own word makes it leave
    m, hosts = membership(tmp_path, members, ["10.0.0.1", "10.0.0.2"], ("experts:7000", "10.0.0.9:7000"))
    hosts.write_text("10.0.0.1 experts\n")
    assert MISSING_ROUNDS == 2 and not m.find_changes()  # once may be a resolver's hiccup
    change = m.find_changes()
    assert [(c.address, why) for c, why in change.leaving] == [("10.0.0.2:7000", "experts:7000 no longer resolves to it")]
    hosts.write_text("")  # resolves to nothing (DNS down, here an unknown name): nobody leaves
    for _ in range(3):
        assert not any(c.address == "10.0.0.1:7000" for c, _ in m.find_changes().leaving)


def test_a_draining_member_leaves_and_an_announcement_is_a_candidate_once(tmp_path):
    members = [Member("10.0.0.1:7000", "experts", draining=True, instance_id="a"),
               Member("10.0.0.2:7000", "experts", instance_id="b")]
    m, _ = membership(tmp_path, members, ["10.0.0.1", "10.0.0.2"])
    assert m.announce(Candidate("10.0.0.2:7000", "", "b")) == (True, "member as 10.0.0.2:7000")
    assert m.announce(Candidate("10.0.0.7:9", "", "b"))[0]  # the same process at another address
    member, message = m.announce(Candidate("10.0.0.5:7000", "10.0.0.5", "c"))
    assert not member and "health-checked" in message
    change = m.find_changes()
    assert change.joining == (Candidate("10.0.0.5:7000", "10.0.0.5", "c"),)
    assert [(c.address, why) for c, why in change.leaving] == [("10.0.0.1:7000", "it is draining")]
    m.candidate_failed(change.joining[0], "UNAVAILABLE")
    assert not m.find_changes().joining  # retried after RETRY_CANDIDATE_S, not every round
    m.announce(Candidate("10.0.0.5:7000", "10.0.0.5", "c"))  # a fresh announcement is tried at once
    assert m.find_changes().joining
    members.append(Member("10.0.0.5:7000", "10.0.0.5", instance_id="c"))
    assert not m.find_changes().joining  # a member now
