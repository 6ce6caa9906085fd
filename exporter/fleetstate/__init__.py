"""What the fleet's answers mean, as pure functions and immutable values: strict consensus and
AND verdicts (``aggregate``), the RL invariants, snapshots, the last hour's history and weight
checksum comparison. No I/O.
"""
