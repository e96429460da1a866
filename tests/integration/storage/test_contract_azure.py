def test_abfs_urls_name_the_same_blobs_with_or_without_the_account_host(az_container):
    from unickpt.storage.azure import AzureBlobStorage

    open_storage(az_container.url("ck")).put("a", b"1")
    for url in (
        f"abfs://{az_container.name}/ck",
        f"abfs://{az_container.name}@devstoreaccount1.dfs.core.windows.net/ck",
    ):
        s = open_storage(url)
        assert isinstance(unwrap(s), AzureBlobStorage) and s.url == url
        assert s.read("a") == b"1"
