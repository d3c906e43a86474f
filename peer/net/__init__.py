"""The network under everything: framed RPC over hivemind P2P, the DHT view and process, identities and record signing, reachability, dial-out, deadlines and polling."""
