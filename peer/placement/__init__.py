"""Which stage a peer serves: the placement rules, the plan over a snapshot, the optimum, stage costs, the benchmark, the rebalancer."""
