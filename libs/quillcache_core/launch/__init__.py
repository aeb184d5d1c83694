"""Starting QuillCache: the `quillcache` command, the local cluster (`quillcache up`) and the etcd launcher."""
