"""One outer round, a member's side: matchmaking, the group, the reducer, gather, the aggregate, the outcome vote."""
