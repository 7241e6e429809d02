"""A Serve replica's tensor-parallel ranks: rank 0 is the replica's own actor, every other
rank a Ray actor in the replica's placement group, all in lock-step over one collective group.
"""

from pdserve.ranks.rank_group import RankGroup, RankSettings, start_ranks

__all__ = ["RankGroup", "RankSettings", "start_ranks"]
