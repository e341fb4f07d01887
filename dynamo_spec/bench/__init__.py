"""`dynamo-spec bench`: does speculation pay on this host and this traffic, and at which batch sizes?"""
