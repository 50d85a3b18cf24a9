"""splitmoe sets its runtime defaults on import, leaves a user's own values alone, and can give a
peer (the llama.cpp baseline) the environment as the user had it."""
import json
import os
import subprocess
import sys

from tests.support.processes import REPO

PROBE = ("import json, os, splitmoe; print(json.dumps([os.environ.get('OMP_WAIT_POLICY'), "
         "os.environ.get('MKL_CBWR'), splitmoe.user_environment().get('OMP_WAIT_POLICY'), "
         "splitmoe.user_environment().get('MKL_CBWR')]))")


def probe(**env) -> list:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "MKL_CBWR")}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env={**base, **env}, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


def test_defaults_are_set_and_the_users_environment_is_kept_apart():
    assert probe() == ["PASSIVE", "AUTO,STRICT", None, None]


def test_a_users_own_values_win():
    assert probe(OMP_WAIT_POLICY="ACTIVE") == ["ACTIVE", "AUTO,STRICT", "ACTIVE", None]
