"""`python -m broker.bench`: Routing cost: request/reply round trips per second through the broker vs a direct pyzmq echo, one run."""

from broker.bench.router import main

main()
