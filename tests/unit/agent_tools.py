"""Tools that misbehave, for tests/unit/test_agent.py (a module of its own: the tool worker imports it quickly)."""
import os
import time


def raises(**kw):
    raise RuntimeError("the tool broke")


def sleeps(seconds: float = 30.0):
    time.sleep(seconds)
    return {"slept": seconds}


def exits():
    os._exit(3)


def not_json():
    return {1, 2}
