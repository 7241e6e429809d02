"""How many tokens of longer prompts' chunks a step may add to rows that are decoding: what a
step-time bound (the decoding rows' TPOT) leaves after those rows' own time, at the measured
cost of a prompt token. Prompts that fit whole in a step are not counted against it.
"""

from __future__ import annotations

# Weight of the newest step in the running averages: the batch and the prompts' context
# lengths change by the second, a step lasts tens of milliseconds.
NEWEST = 0.2


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + NEWEST * (new - old)


class PromptAllowance:
    """``budget`` prompt tokens per step at most (0: no cap) and one ``block`` at least (a
    prompt always moves): as many as fit in ``bound_s`` after the decoding rows' own step
    time, at the prompt tokens' measured cost. One block until both are measured.

    Why a cost model and not probing (halve on a slow step, grow on a fast one): each probe
    past the bound is a step every decoding row waits through, and those make TPOT's p99."""

    def __init__(self, budget: int, bound_s: float, block: int) -> None:
        self.budget = budget
        self.bound_s = bound_s
        self.block = max(1, min(block, budget)) if budget else block
        self.tokens = self.block if budget else 0
        self.decode_s: float | None = None  # a step of decoding rows alone
        self.token_s: float | None = None  # what one prompt token adds to such a step

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def observe(self, seconds: float, num_decode_rows: int, num_prompt_tokens: int) -> None:
        """A step's measured time and what it carried."""
        if not self.enabled or num_decode_rows == 0:
            return
        if num_prompt_tokens == 0:
            self.decode_s = _average(self.decode_s, seconds)
        elif self.decode_s is not None:
            added = max(0.0, seconds - self.decode_s) / num_prompt_tokens
            self.token_s = _average(self.token_s, added)
        room = self.room()
        if room is not None:
            self.tokens = max(self.block, min(self.budget, room // self.block * self.block))

    def room(self) -> int | None:
        """Prompt tokens that fit in a step within the bound (None: not measured yet)."""
        if self.decode_s is None or not self.token_s:
            return None
        return max(0, int((self.bound_s - self.decode_s) / self.token_s))

    def lend_tokens_per_s(self) -> int:
        """Prompt tokens a second the steps would take within the bound, past the one block
        a step every prompt gets (0: none, or not measured)."""
        room = self.room()
        if room is None or room < 2 * self.block:
            return 0
        return int(min(self.budget, room) / self.bound_s)

    def token_us(self) -> int:
        """What one prompt token adds to a step, in microseconds (0: not measured)."""
        return int(self.token_s * 1e6) if self.token_s else 0
