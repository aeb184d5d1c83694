"""This node's side of the block-data path: the port peers pull from and clients put to
(`server`), and its own pulls from peers (`pull`). The protocol's framing and the
client side are `quillcache_core.storeclient.datapath`."""
