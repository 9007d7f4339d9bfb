/* Everything the bindings cover. fi_ext.h (libfabric >= 1.14) carries FI_OPT_* extensions. */
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_errno.h>
#if __has_include(<rdma/fi_ext.h>)
#include <rdma/fi_ext.h>
#endif
