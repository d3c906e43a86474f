"""The command line: `swarmgrad peer | coordinator | status | demo | simulate | keygen | invite | export`, and the launcher of local swarms."""
