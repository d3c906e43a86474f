"""The round logic: the round clock, the runner that ends, averages and applies each round, overlapped rounds."""
