# The Debian package: `cpack` in the build directory (or `cpack --config <build>/CPackConfig.cmake
# -B <dir>`) packs everything `cmake --install` installs, under /usr, with /etc/moecache and the
# systemd directories where they belong. include()d by the top-level CMakeLists.txt after every
# install rule, so that CPack is set up in the top-level scope.
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME moecache)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_VENDOR moecache)
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "keeps the hot experts of Mixture-of-Experts models in RAM and VRAM")
set(CPACK_DEBIAN_PACKAGE_DESCRIPTION "${CPACK_PACKAGE_DESCRIPTION_SUMMARY}
 moecache runs Mixture-of-Experts models that are larger than VRAM, often larger than RAM, with
 an unmodified GGUF runtime (llama.cpp, ollama, ...). moecached, a systemd service, locks and
 prefetches the hot experts in the page cache within budgets, backs off under memory pressure
 and watches the page cache with eBPF; libmoecache-cuda.so, preloaded into the runtime, serves
 hot experts from a VRAM pool. Also moecachectl (control over D-Bus), libmoecache-client,
 moecache-mkmodel (synthetic MoE models), moecache-tracegen (synthetic router traces) and
 moecache-sim (replays traces against the placement policy and its baselines).")
set(MOECACHE_PACKAGE_MAINTAINER "moecache maintainers <maintainers@moecache.invalid>" CACHE STRING
    "The Maintainer field of the Debian package")
set(CPACK_PACKAGE_CONTACT "${MOECACHE_PACKAGE_MAINTAINER}")
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "${MOECACHE_PACKAGE_MAINTAINER}")
set(CPACK_DEBIAN_PACKAGE_SECTION admin)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)

# Libraries from dpkg-shlibdeps; dbus for the system bus the daemon and moecachectl talk over.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_DEPENDS "dbus")
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "systemd")

# Installed as `cmake --install --prefix /usr` would, whatever prefix the build was configured
# with; files with absolute destinations (/etc, /usr/lib/systemd) land beside them (DESTDIR).
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_INSTALL_PREFIX /usr)
set(CPACK_SET_DESTDIR ON)
set(CPACK_STRIP_FILES ON)

set(_conffiles ${CMAKE_BINARY_DIR}/packaging/conffiles)
file(WRITE ${_conffiles} "${MOECACHE_CONFIG_DIR}/moecached.toml\n")
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
    ${CMAKE_CURRENT_LIST_DIR}/debian/postinst
    ${CMAKE_CURRENT_LIST_DIR}/debian/prerm
    ${CMAKE_CURRENT_LIST_DIR}/debian/postrm
    ${_conffiles})
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
include(CPack)
