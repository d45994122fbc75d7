"""A clock a test moves by hand: pass it where a component takes `clock=` and add to `now`."""


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now
