"""Helpers shared by several test modules, imported as ``support.NAME`` (pytest puts tests/ on
sys.path, as for ``conftest``): one module per subject. `support.state`: stage states and their
donors; `support.dht`, `support.transport`, `support.rpc`: fakes of hivemind's DHT and P2P streams
and of FramedRPC calls; `support.swarm`: an in-process swarm of real peers over those fakes, so a
test of swarm logic runs in one event loop in seconds."""
