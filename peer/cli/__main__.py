"""`python -m swarmgrad.peer.cli`: the same as the `swarmgrad` command."""
from swarmgrad.peer.cli.main import main

raise SystemExit(main())
