"""A --host_discovery_script for tests: prints each HOST:SLOTS given, except the hosts that
train_case.py --lose_host marked lost (a lost-HOST file in DIR).

usage: discover_hosts.py DIR HOST:SLOTS [HOST:SLOTS ...]"""
import os
import sys

directory, hosts = sys.argv[1], sys.argv[2:]
for entry in hosts:
    if not os.path.exists(os.path.join(directory, "lost-" + entry.split(":")[0])):
        print(entry)
