"""Private runs, a peer's side: admission (the gate every RPC asks), the DHT authorizer, joining with an invitation."""
