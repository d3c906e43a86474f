"""swarmgrad's benchmarks, each run from the repository root as ``python -m benchmarks.NAME``.

Every benchmark takes ``--quick`` (a smoke run of a minute or two), ``--out DIR`` (write
``report.md``, ``results.json`` and its figures as PNG there) and ``--seed N``, and runs what it
compares side by side in one invocation (the machines these ran on are shared: only figures of
one run compare). The shared machinery is in ``benchmarks/harness/``: the swarm runner (on
``swarmgrad.peer.cli.launcher.LocalSwarm``, the demo's), the single-process training loop (the
peers' own inner optimiser, schedule and model), network namespaces, and the report writer.

In one process, no network:
  boundary_codecs     pipeline-boundary codecs, measured by training the reference model
  lookahead_quality   what one-step-stale stage gradients (pipeline.lookahead) cost per sample,
                      and each pipeline.stale_correction
  subspace_boundary   subspace-constrained boundaries (model.boundary_subspace) against the
                      unconstrained Llama at equal samples
  sparse_rounds       pseudo-gradient codecs and overlapped rounds in exact DiLoCo rounds
  swarm_moment_step   what inner.swarm_second_moment costs per inner step
  codecs              swarmgrad's codecs against hivemind's on the same tensors
  simulate            the placement policy against its ablations in the simulator
  round_tickets       what signing and checking a driver's round ticket costs
  reducer_verify      what averaging.verify (signed parts, every mean recomputed) costs per round
  compute_queue       what waits on a stage's compute thread, and behind what (in-process peers
                      over a shaped loopback link; pipeline.forward_first)

Real peer processes on 127.0.0.1:
  pipeline_overhead   one process alone against the demo swarm on the same model
  round_codecs        averaging codecs at equal samples in the demo swarm
  schedule            constant lr against warmup + cosine on the reference task
  byzantine           a hostile replica against robust averaging
  rebalance           unequal peers: the swarm's throughput against the best placement
  chaos               chaos soak: a random peer SIGKILLed and replaced every few seconds
  lm_quality          the Llama CPU preset on Debian's fortunes: one process against 2 replicas
                      and 2 stages x 2 replicas at equal tokens (nats/token, perplexity, bits/byte)

In network namespaces (root; each says why and exits 0 without):
  wan                 swarmgrad against DDP and hivemind.Optimizer over emulated WAN links
                      (its baselines' trainers: wan_baselines)
  overlap             overlapped averaging against plain rounds over a slow link
  pipeline_link       whether the 2-stage pipeline fills its link
  pipeline_wan        2 stages x 2 replicas of the Llama preset, no peer holding the model, over
                      unshaped, 100 and 20 Mbit links and one 5 Mbit replica; rows are manifest
                      overrides (issue 45's table)
  nat_probe           who can call whom behind NAT (bare hivemind DHT nodes)
  scale               state downloads, averaging, memory, codec and tokens/s at 20M-125M parameters
                      (shaped links where it can; loopback with --loopback)
"""
