"""The discrete-event simulator that plays the placement rules over hundreds of peers (`swarmgrad simulate`)."""
